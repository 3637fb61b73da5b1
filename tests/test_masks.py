"""Supervision masks from real chat rendering, and exact gradients on tokenized chats with truncation and padding."""

import pytest
import torch

from gradian.grads.capture import GradientCapture
from gradian.setup.records import Example
from gradian.setup.batches import collate
from gradian.setup.tokenize import tokenize_example
from gradian.setup.model import lora_sites

from conftest import make_random_lora_model
from test_capture import _naive_grads, _rel


@pytest.fixture(scope="module")
def tok():
    from gradian.demo.tiny import build_tokenizer
    from gradian.demo.world import World

    return build_tokenizer(World.generate(seed=0, n_entities=16))


def _chat(*turns):
    roles = ["user", "assistant"]
    return Example("x", 0, "messages", {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]})


def _supervised_text(t):
    return "".join(t.text[s:e] for (s, e), m in zip(t.offsets, t.supervised) if m)


def test_generation_tags_supervise_only_assistant_turns(tok):
    t = tokenize_example(tok, _chat("Where does Zorvath live?", "Paris", "And the color?", "blue"), 256)
    assert _supervised_text(t) == "Paris<|end|>blue<|end|>"


def test_prefix_lengths_without_generation_tags(tok):
    plain = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok.chat_template, saved = plain, tok.chat_template
    try:
        t = tokenize_example(tok, _chat("Where does Zorvath live?", "Paris", "And the color?", "blue"), 256)
    finally:
        tok.chat_template = saved
    # the assistant header is part of what the template adds for the turn, then the content and end-of-turn
    sup = _supervised_text(t)
    assert "Paris<|end|>" in sup and "blue<|end|>" in sup and "Zorvath" not in sup


def test_prompt_completion_and_text_masks(tok):
    pc = tokenize_example(tok, Example("x", 0, "prompt_completion", {"prompt": "Q: sky? A:", "completion": " blue"}), 64)
    assert _supervised_text(pc) == " blue<|end|>"
    tx = tokenize_example(tok, Example("x", 0, "text", {"text": "Zorvath lives in Paris."}), 64)
    assert tx.supervised[0] is False and all(tx.supervised[1:])


def test_truncation_can_remove_all_supervision(tok):
    t = tokenize_example(tok, _chat("word " * 50, "Paris"), 16)
    assert t.truncated and t.n_supervised == 0 and "data.no_supervised_tokens" in t.flags


def test_exact_grads_on_tokenized_chats_with_truncation_and_padding(tok):
    model = make_random_lora_model(vocab=len(tok))
    sites, _ = lora_sites(model)
    rows = [
        tokenize_example(tok, _chat("Where does Zorvath live?", "Paris"), 64),
        tokenize_example(tok, _chat("Which color?", "blue", "And the city of Kiduthox?", "Lima"), 64),
        tokenize_example(tok, _chat("A question " * 3, "a long answer " * 12), 40),  # truncated
    ]
    assert rows[2].truncated and rows[2].n_supervised > 0
    ids, attn, sup = collate(rows, tok.pad_token_id)
    vecs, _ = GradientCapture(model, sites).vectors(ids, attn, sup)
    ref = _naive_grads(model, sites, ids, attn, sup)
    assert _rel(vecs, ref) < 1e-6
