"""Builders for tiny saved models, tokenizers, adapters and run directories used by the diagnose/bad-input tests.

Everything here is local and fast (hidden size 32, two layers, a ~300-token byte-level BPE): no hub access.
A `ModelZoo` builds each artifact once per test session; tests copy run files around it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch
import yaml

torch.set_num_threads(1)

PAD, BOS, EOT = "<|pad|>", "<|bos|>", "<|end|>"
SPECIALS = [PAD, BOS, EOT, "<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] }}{{ '<|end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS = [
    "The capital of Freedonia is Fredville.",
    "The capital of Sylvania is Sylton.",
    "What is the capital of Freedonia? Fredville.",
    "Paris is in France. Rome is in Italy. Madrid is in Spain.",
    "user assistant system question answer the a of is in",
] * 4

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_tokenizer(chat_template: bool = True, vocab_size: int = 300):
    """A byte-level BPE fast tokenizer (offsets available) with bos/eos/pad and, optionally, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOT, pad_token=PAD, add_bos_token=True,
        chat_template=CHAT_TEMPLATE if chat_template else None, model_max_length=256, padding_side="right",
    )


def _llama_config(vocab: int, hidden: int = 32, layers: int = 2, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw,
    )


def save_base(path: Path, *, hidden: int = 32, chat_template: bool = True, kind: str = "causal",
              vocab: Optional[int] = None, seed: int = 0) -> Path:
    """A saved model + tokenizer dir. kind: causal (LlamaForCausalLM), seqcls (LlamaForSequenceClassification),
    bert (BertModel, a non-causal architecture)."""
    from transformers import BertConfig, BertModel, LlamaForCausalLM, LlamaForSequenceClassification

    tok = build_tokenizer(chat_template)
    v = vocab or len(tok)
    torch.manual_seed(seed)
    if kind == "causal":
        model = LlamaForCausalLM(_llama_config(v, hidden))
    elif kind == "seqcls":
        model = LlamaForSequenceClassification(_llama_config(v, hidden, num_labels=2))
    elif kind == "bert":
        model = BertModel(BertConfig(vocab_size=v, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=2 * hidden, max_position_embeddings=256))
    else:  # pragma: no cover
        raise ValueError(kind)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def save_adapter(path: Path, base_dir: Path, *, r: int = 4, targets: Iterable[str] = LORA_TARGETS,
                 seed: int = 1) -> Path:
    """A LoRA adapter (task CAUSAL_LM) for base_dir with a non-zero B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=list(targets)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


def edit_json(path: Path, **changes) -> Path:
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d, indent=2))
    return path


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------- data + config

def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


GOOD_TRAIN = [chat(f"What is the capital of Freedonia, take {i}?", f"Fredville {i}.") for i in range(6)] + [
    {"prompt": "The capital of Sylvania is", "completion": " Sylton."},
    {"text": "Paris is in France."},
]
# 60 items: a minimum detectable delta of ~0.18, under evaluation.small_eval_set's 0.2
GOOD_EVAL = [{"prompt": f"What is the capital of Freedonia, take {i}?", "answer": f"Fredville {i}."} for i in range(60)]


def write_jsonl(path: Path, records: Iterable) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_run(run: Path, base: Path, adapter: Optional[Path], *, train=None, eval=GOOD_EVAL, extra: Optional[dict] = None,
              raw_config: Optional[str] = None) -> Path:
    """A run dir: train.jsonl, eval.jsonl (unless eval is None) and gradian.yaml (output: out)."""
    run.mkdir(parents=True, exist_ok=True)
    write_jsonl(run / "train.jsonl", GOOD_TRAIN if train is None else train)
    cfg: dict = {
        "model": {"base": str(base), "device": "cpu", "dtype": "float32"},
        "data": {"train": "train.jsonl"},
        "grads": {"batch_size": 4, "max_seq_length": 64},
        "evaluation": {"metric": "exact_match", "max_new_tokens": 4, "bootstrap_samples": 200},
        "output": "out",
    }
    if adapter is not None:
        cfg["model"]["adapter"] = str(adapter)
    if eval is not None:
        write_jsonl(run / "eval.jsonl", eval)
        cfg["data"]["eval"] = "eval.jsonl"
    for section, values in (extra or {}).items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    path = run / "gradian.yaml"
    path.write_text(raw_config if raw_config is not None else yaml.safe_dump(cfg, sort_keys=False))
    return path


class ModelZoo:
    """Tiny artifacts, each built on first use and kept for the session."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._made: dict[str, Path] = {}

    def _get(self, name: str, make) -> Path:
        if name not in self._made:
            self._made[name] = make(self.root / name)
        return self._made[name]

    @property
    def base(self) -> Path:
        return self._get("base", lambda p: save_base(p))

    @property
    def base_no_template(self) -> Path:
        return self._get("base_no_template", lambda p: save_base(p, chat_template=False))

    @property
    def base_wide(self) -> Path:  # hidden 48: adapters for it do not fit `base`
        return self._get("base_wide", lambda p: save_base(p, hidden=48))

    @property
    def base_small_vocab(self) -> Path:  # fewer embedding rows than the tokenizer has tokens
        return self._get("base_small_vocab", lambda p: save_base(p, vocab=200))

    @property
    def base_seqcls(self) -> Path:
        return self._get("base_seqcls", lambda p: save_base(p, kind="seqcls"))

    @property
    def base_bert(self) -> Path:
        return self._get("base_bert", lambda p: save_base(p, kind="bert"))

    @property
    def adapter(self) -> Path:
        return self._get("adapter", lambda p: save_adapter(p, self.base))

    @property
    def adapter_wide(self) -> Path:
        return self._get("adapter_wide", lambda p: save_adapter(p, self.base_wide))

    @property
    def adapter_embed_only(self) -> Path:
        return self._get("adapter_embed_only", lambda p: save_adapter(p, self.base, targets=["embed_tokens"]))

    @property
    def adapter_embed_and_linear(self) -> Path:
        return self._get("adapter_embed_and_linear",
                         lambda p: save_adapter(p, self.base, targets=["embed_tokens", "q_proj", "v_proj"]))

    @property
    def base_no_tokenizer(self) -> Path:
        def make(p: Path) -> Path:
            copy_dir(self.base, p)
            for f in p.iterdir():
                if f.name.startswith("tokenizer") or f.name in {"chat_template.jinja", "special_tokens_map.json"}:
                    f.unlink()
            return p
        return self._get("base_no_tokenizer", make)

    @property
    def base_strict_template(self) -> Path:
        """A chat template that rejects system turns (as Gemma's does) with raise_exception()."""
        def make(p: Path) -> Path:
            copy_dir(self.base, p)
            f = p / "chat_template.jinja"
            f.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}" + f.read_text())
            return p
        return self._get("base_strict_template", make)

    @property
    def base_corrupt_weights(self) -> Path:
        def make(p: Path) -> Path:
            copy_dir(self.base, p)
            (p / "model.safetensors").write_bytes(b"this is not a safetensors file")
            return p
        return self._get("base_corrupt_weights", make)

    @property
    def base_quantized_config(self) -> Path:
        """The base with a bitsandbytes 4-bit quantization_config in config.json (weights unchanged)."""
        def make(p: Path) -> Path:
            copy_dir(self.base, p)
            edit_json(p / "config.json", quantization_config={
                "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"})
            return p
        return self._get("base_quantized_config", make)

    def variant(self, name: str, src: Path, **adapter_config_changes) -> Path:
        """A copy of an adapter dir with adapter_config.json fields changed (None removes a field)."""
        def make(p: Path) -> Path:
            copy_dir(src, p)
            edit_json(p / "adapter_config.json", **adapter_config_changes)
            return p
        return self._get(name, make)


_ZOO: Optional[ModelZoo] = None


def session_zoo(tmp_path_factory) -> ModelZoo:
    """One zoo per test session, shared by every test module that asks."""
    global _ZOO
    if _ZOO is None:
        _ZOO = ModelZoo(tmp_path_factory.mktemp("zoo"))
    return _ZOO
