import os

import pytest
import torch

os.environ.setdefault("GRADIAN_THREADS", "1")
torch.set_num_threads(1)


def make_random_lora_model(seed: int = 0, vocab: int = 97, hidden: int = 32, layers: int = 2, r: int = 4, dtype=torch.float32):
    """A random Llama with a LoRA adapter whose B is non-zero (a fresh adapter's B is 0, which hides A's gradient)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(cfg).to(dtype)
    lcfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return with_random_lora_b(get_peft_model(base, lcfg))


def with_random_lora_b(model, std: float = 0.05):
    """A fresh adapter's B is 0, which hides A's gradient: draw B at random (seeded by the caller) and go to eval."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    model.eval()
    return model


@pytest.fixture
def random_lora_model():
    return make_random_lora_model()
import gradian.runtime as _r; _r.quiet_libraries()


def words(s: str) -> str:
    """Text with every run of white space made one space (CLI output compared whatever the wrapping)."""
    return " ".join(s.split())
