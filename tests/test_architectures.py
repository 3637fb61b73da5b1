"""Per-example LoRA gradients on the model families users fine-tune, against the naive reference (one example per
backward pass, full fp32 logits): the capture, the chunked LM-head loss and its fallbacks must not depend on Llama."""

from __future__ import annotations

import pytest
import torch

from gradian.grads.capture import GradientCapture
from gradian.setup.model import lora_sites

from conftest import with_random_lora_b
from test_capture import _batch, _naive_grads, _rel

torch.set_num_threads(1)

H = 32


def _families():
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    out = {
        # tied input/output embeddings: the LM head is the embedding matrix
        "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {**common, "tie_word_embeddings": True}, None),
        # biases on q/k/v
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**common, "tie_word_embeddings": False}, None),
        "mistral": ("MistralConfig", "MistralForCausalLM", {**common, "tie_word_embeddings": False}, None),
        # scaled embeddings, final logit soft-capping, sandwich norms
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**common, "head_dim": 8, "final_logit_softcapping": 30.0,
                                                          "attn_logit_softcapping": 50.0}, None),
        # fused qkv_proj and gate_up_proj
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {**common, "pad_token_id": 0, "tie_word_embeddings": False},
                 ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    }
    return {k: v for k, v in out.items() if hasattr(tf, v[0]) and hasattr(tf, v[1])}


FAMILIES = _families()


def _model(family: str):
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    cfg_name, cls_name, kw, targets = FAMILIES[family]
    torch.manual_seed(0)
    base = getattr(tf, cls_name)(getattr(tf, cfg_name)(**kw)).float()
    return with_random_lora_b(get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                               target_modules=targets or "all-linear")))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capture_equals_naive_reference(family):
    model = _model(family)
    sites, _ = lora_sites(model)
    assert sites, family
    ids, attn, sup = _batch()
    vecs, losses = GradientCapture(model, sites, chunk=5).vectors(ids, attn, sup)
    ref, ref_losses = _naive_grads(model, sites, ids, attn, sup, with_losses=True)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    off = 0
    for s in sites:
        assert _rel(vecs[:, off : off + s.numel], ref[:, off : off + s.numel]) < 1e-5, (family, s.name)
        off += s.numel


def test_bfloat16_model_gives_fp32_vectors_close_to_the_fp32_model():
    """A bf16 model (model.dtype: bfloat16) is captured in fp32 accumulation: the vectors agree with the fp32 model's
    to bf16 precision, and the loss is upcast at supervised positions only (finite, close)."""
    from conftest import make_random_lora_model

    ids, attn, sup = _batch()
    m32 = make_random_lora_model(dtype=torch.float32)
    m16 = make_random_lora_model(dtype=torch.bfloat16)
    s32, _ = lora_sites(m32)
    s16, _ = lora_sites(m16)
    v32, l32 = GradientCapture(m32, s32, chunk=5).vectors(ids, attn, sup)
    v16, l16 = GradientCapture(m16, s16, chunk=5).vectors(ids, attn, sup)
    assert v16.dtype == torch.float32 and l16.dtype == torch.float32
    assert torch.isfinite(v16).all()
    assert _rel(v16, v32) < 0.05
    torch.testing.assert_close(l16, l32, rtol=0.02, atol=0.05)
