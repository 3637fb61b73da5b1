"""Greedy answers as transformers gives them: Gradian's batched, left-padded generation equals `model.generate` on
each prompt alone (the same prompt ids, greedy, the same stop tokens), on both real models: SmolLM2's chat prompts
and Gemma-3's plain prompts with <bos> (sliding-window attention under left padding)."""

from __future__ import annotations

import pytest
import torch

from gradian.capability.evaluate import _stop_ids, generate_answers
from gradian.setup.records import EvalItem
from gradian.setup.tokenize import eval_prompt_ids
from real_models import gemma3, gemma3_dir, smollm2, smollm2_dir  # noqa: F401

pytestmark = pytest.mark.real

QUESTIONS = ["What is the capital of France?", "Which city is the capital of Japan, the island country in East Asia?",
             "Name a color.", "What is the capital of Egypt?", "Sort 3, 1, 2 from smallest to largest.",
             "Which ocean is the largest on Earth?"]


def alone(model, tok, ids, max_new_tokens, stops):
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_batched_answers_equal_generate_alone(which, request):
    model, tok = request.getfixturevalue(which)
    chat = which == "smollm2"
    if chat:
        items = [EvalItem(f"e{i}", i, "x", messages=[{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS)]
    else:
        items = [EvalItem(f"e{i}", i, "x", prompt=f"Question: {q}\nAnswer:") for i, q in enumerate(QUESTIONS)]
    n = 12
    batched = generate_answers(model, tok, items, chat=chat, max_new_tokens=n, batch_size=len(items))
    stops = _stop_ids(tok, model, chat)
    if not chat:  # a base model's plain prompt stops where model.generate stops by default
        assert stops == sorted({tok.eos_token_id, *([model.generation_config.eos_token_id]
                                                     if isinstance(model.generation_config.eos_token_id, int)
                                                     else model.generation_config.eos_token_id)})
    lengths = {len(eval_prompt_ids(tok, it, chat)) for it in items}
    assert len(lengths) > 1  # the batch really is left-padded
    for it, b in zip(items, batched):
        assert b == alone(model, tok, eval_prompt_ids(tok, it, chat), n, stops), it
    if which == "gemma3":  # the bug this guards: no <bos>, and the base answers garbage
        assert "Paris" in batched[0] and "Tokyo" in batched[1]
