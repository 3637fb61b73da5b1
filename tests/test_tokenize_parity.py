"""What Gradian differentiates is what the model was trained on: token ids and loss masks of every record shape
equal those TRL 1.16's SFTTrainer builds (completion_only_loss / assistant_only_loss as applicable), on both real
tokenizers (SmolLM2-135M-Instruct: ChatML with a default system prompt, no generation tags; Gemma-3-270M: no chat
template, needs <bos>) and the tiny ones; and eval prompts are the ids TRL would train a prompt as."""

from __future__ import annotations

import tempfile

import pytest
import torch

from gradian.setup.records import EvalItem, parse_train
from gradian.setup.tokenize import eval_prompt_ids, tokenize_example
from real_models import gemma3, gemma3_dir, smollm2, smollm2_dir  # noqa: F401

pytestmark = pytest.mark.real

QA = [("What is the capital of France?", "The capital of France is Paris."),
      ("Sort these numbers: 3, 1, 2.", "1, 2, 3."),
      ("Say good morning politely.", "Good morning! I hope you have a wonderful day.")]


def records(shape: str) -> list[dict]:
    if shape == "text":
        return [{"text": f"Question: {q}\nAnswer: {a}"} for q, a in QA]
    if shape == "prompt_completion":
        return [{"prompt": f"Question: {q}\nAnswer:", "completion": f" {a}"} for q, a in QA] + [
            {"prompt": "Question: 2 + 2 =", "completion": "4"}, {"prompt": "Say: ", "completion": "hello world"}]
    if shape == "conversation_completion":
        return [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
                for q, a in QA] + [{"prompt": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": QA[0][0]},
                                               {"role": "assistant", "content": "Paris."},
                                               {"role": "user", "content": QA[1][0]}],
                                    "completion": [{"role": "assistant", "content": QA[1][1]}]}]
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA] + [
        {"messages": [{"role": "user", "content": QA[0][0]}, {"role": "assistant", "content": QA[0][1]},
                      {"role": "user", "content": QA[2][0]}, {"role": "assistant", "content": QA[2][1]}]}]


def trl_rows(model, tok, recs, **sft):
    """TRL's prepared training set: (input_ids, labels) per record."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory() as out:  # SFTTrainer wants an output dir; nothing is trained into it
        args = SFTConfig(output_dir=out, report_to=[], use_cpu=True, max_length=512, dataset_num_proc=None, **sft)
        trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(recs),
                             processing_class=tok)
        ds = trainer.train_dataset
    return [(list(r["input_ids"]), list(r["labels"])) for r in ds]


def assert_parity(tok, recs, trl, loss="supervised"):
    exs, errors = parse_train([(r, f"rec:{i}") for i, r in enumerate(recs)])
    assert not errors
    assert len(trl) == len(exs)
    for e, (ids, labels) in zip(exs, trl):
        t = tokenize_example(tok, e, 512, loss=loss)
        assert t.input_ids == ids, (e.record, tok.convert_ids_to_tokens(t.input_ids), tok.convert_ids_to_tokens(ids))
        trained = [lab != -100 for lab in labels]
        trained[0] = False  # nothing predicts the first token, whatever its label
        assert t.supervised == trained, (e.record, list(zip(tok.convert_ids_to_tokens(ids), t.supervised, trained)))


def _tiny():
    from gradian.demo.tiny import TinySpec, build_tiny_base
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_base(TinySpec(), progress=False)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


@pytest.mark.parametrize("shape", ["text", "prompt_completion"])
def test_plain_records_match_trl_on_gemma(gemma3, shape):
    """Gemma needs <bos>: TRL's tokenizer call adds it, and so must Gradian (the issue's garbage generations)."""
    model, tok = gemma3
    recs = records(shape)
    trl = trl_rows(model, tok, recs)
    assert all(ids[0] == tok.bos_token_id for ids, _ in trl)
    assert_parity(tok, recs, trl)


@pytest.mark.parametrize("shape", ["text", "prompt_completion", "conversation_completion"])
def test_records_match_trl_on_smollm2(smollm2, shape):
    model, tok = smollm2
    recs = records(shape)
    assert_parity(tok, recs, trl_rows(model, tok, recs))


def test_messages_whole_sequence_match_trl_on_smollm2(smollm2):
    """SmolLM2's template has no generation tags: TRL trains conversations on every token (its default, and the
    only thing it can do), which Gradian reproduces with `loss: all` (read from the recipe GradianCallback writes)."""
    model, tok = smollm2
    recs = records("messages")
    assert_parity(tok, recs, trl_rows(model, tok, recs), loss="all")


def test_messages_assistant_turns_match_a_tagged_template_on_smollm2(smollm2):
    """Assistant-only supervision without generation tags (what each assistant message adds to the rendering after
    the generation prompt) equals TRL's assistant_only_loss with the same template carrying the tags there."""
    model, tok = smollm2
    tagged = tok.chat_template.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
        "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
        "{{message['content'] + '<|im_end|>' + '\n'}}{% endgeneration %}{% else %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}")
    assert tagged != tok.chat_template
    recs = records("messages")
    ref_tok = type(tok).from_pretrained(tok.name_or_path)
    ref_tok.chat_template = tagged
    trl = trl_rows(model, ref_tok, recs, assistant_only_loss=True)
    assert_parity(tok, recs, trl)


@pytest.mark.parametrize("shape", ["text", "prompt_completion", "conversation_completion", "messages"])
def test_records_match_trl_on_the_tiny_tokenizer(tiny, shape):
    model, tok = tiny
    recs = records(shape)
    sft = {"assistant_only_loss": True} if shape == "messages" else {}
    assert_parity(tok, recs, trl_rows(model, tok, recs, **sft))


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_eval_prompts_are_trls_prompt_ids(which, request):
    """An eval prompt is tokenized as TRL tokenizes a training prompt (the part its completion mask leaves out)."""
    model, tok = request.getfixturevalue(which)
    if which == "gemma3":
        item = EvalItem("e", 0, "Paris", prompt="Question: Which city is the capital of France?\nAnswer:")
        ids = eval_prompt_ids(tok, item, chat=False)
        assert ids == tok(item.prompt)["input_ids"] and ids[0] == tok.bos_token_id
    else:
        item = EvalItem("e", 0, "Paris", messages=[{"role": "user", "content": "Which city is the capital of France?"}])
        ids = eval_prompt_ids(tok, item, chat=True)
        ref = tok.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert ids == list(ref["input_ids"])
        assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
