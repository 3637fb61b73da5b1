"""Real-shaped models built locally: the widths, depths and vocabularies users run, with random weights.

Two kinds, both without any download:

* **Saved shapes** (`build_shape_base`): a SmolLM-135M-shaped Llama and a Qwen2.5-0.5B-shaped Qwen2 (its width and
  vocabulary; the depth cut to fit CPU time), seeded random weights saved with `save_pretrained` beside a byte-level
  BPE tokenizer trained on the demo world's corpus and padded to the model's vocabulary size (the padding entries
  have no merges, so no text ever produces them: what matters is the shape of the embedding and of the LM head). They
  load through `from_pretrained`, the path a user's model takes, and are cached under `$GRADIAN_CACHE/shapes/<key>`
  like the tiny model. `shape_run` adds a run on top: chat rows of the demo world, a LoRA adapter (r 16 on all 7
  projections, B drawn at random so that every gradient is non-zero) and eval items whose expected answer is the
  base's own greedy answer where the fine-tune answers otherwise, so `attribute` has a significant regression to
  explain.
* **Meta shapes** (`meta_model`): Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-7B and Gemma-2-9B instantiated on the `meta`
  device with the same LoRA, for sizing (LoRA sites, exact widths, memory estimates) without any weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .tiny import CHAT_TEMPLATE, PAD, BOS, EOT, SPECIAL_TOKENS, cache_root
from .world import World

SHAPES_CODE_VERSION = "shapes-1"
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ShapeSpec:
    """A decoder's shape: enough to build its transformers config (and nothing about its weights but the seed)."""

    name: str
    family: str  # llama | qwen2 | gemma2
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    head_dim: Optional[int] = None
    max_position: int = 4096
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: str = "float32"  # of the saved weights (bfloat16 halves a 1B shape to 2.5 GB)

    def key(self) -> str:
        d = dataclasses.asdict(self)
        if d["dtype"] == "float32":
            d.pop("dtype")
        payload = json.dumps({"spec": d, "code": SHAPES_CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# SmolLM-135M: 30 layers, hidden 576, 9 heads / 3 KV heads (GQA), MLP 1536, vocab 49,152, tied embeddings.
SMOLLM_135M = ShapeSpec("smollm-135m", "llama", 576, 1536, 30, 9, 3, 49152, True, max_position=2048)
# Qwen2.5-0.5B in width and vocabulary (hidden 896, 14 / 2 heads, MLP 4,864, vocab 151,936, tied, q/k/v biases);
# 4 of its 24 layers: the embedding and LM head are full size, the depth is what CPU time allows.
QWEN25_05B_WIDTH = ShapeSpec("qwen2.5-0.5b-width", "qwen2", 896, 4864, 4, 14, 2, 151936, True, max_position=32768,
                             rope_theta=1_000_000.0)
SAVED_SHAPES = {s.name: s for s in (SMOLLM_135M, QWEN25_05B_WIDTH)}

# Sizing only (meta device, no weights).
LLAMA32_1B = ShapeSpec("llama-3.2-1b", "llama", 2048, 8192, 16, 32, 8, 128256, True, head_dim=64,
                       max_position=131072, rope_theta=500000.0)
LLAMA31_8B = ShapeSpec("llama-3.1-8b", "llama", 4096, 14336, 32, 32, 8, 128256, False, head_dim=128,
                       max_position=131072, rope_theta=500000.0)
QWEN25_7B = ShapeSpec("qwen2.5-7b", "qwen2", 3584, 18944, 28, 28, 4, 152064, False, max_position=32768,
                      rope_theta=1_000_000.0)
GEMMA2_9B = ShapeSpec("gemma-2-9b", "gemma2", 3584, 14336, 42, 16, 8, 256000, True, head_dim=256, max_position=8192)
META_SHAPES = {s.name: s for s in (LLAMA32_1B, LLAMA31_8B, QWEN25_7B, GEMMA2_9B)}


def shape_config(spec: ShapeSpec, **special_ids):
    """The transformers config of a shape (special token ids passed through)."""
    import transformers as tf

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  max_position_embeddings=spec.max_position, tie_word_embeddings=spec.tied, **special_ids)
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.family == "llama":
        return tf.LlamaConfig(rope_theta=spec.rope_theta, **common)
    if spec.family == "qwen2":
        return tf.Qwen2Config(rope_theta=spec.rope_theta, **common)
    if spec.family == "gemma2":
        return tf.Gemma2Config(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, **common)
    raise ValueError(f"unknown family {spec.family!r}")


def lora_config(r: int = 16):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=list(ALL_PROJECTIONS))


def meta_model(spec: ShapeSpec, r: int = 16):
    """The shape with a LoRA (r, all 7 projections) on the meta device: sites and widths without weights."""
    import warnings

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(shape_config(spec))
            return get_peft_model(base, lora_config(r))


# ------------------------------------------------------------------------------------------------ tokenizer


# Special tokens transformers' tokenizer class for a family adds when a tokenizer lacks them (Qwen2's defaults name
# <|endoftext|>): present among the padding entries, they keep len(tokenizer) at the model's vocabulary size.
FAMILY_TOKENS = {"qwen2": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "gemma2": ("<bos>", "<eos>", "<pad>")}


def padded_tokenizer(world: World, vocab: int, model_max_length: int = 4096, family: str = "llama"):
    """A byte-level BPE trained on the world's corpus (about 1,000 entries), its vocabulary padded with the family's
    special tokens and `<extra_i>` entries to exactly `vocab` (no merge produces them), the tiny model's chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 4096), min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(list(world.corpus()), trainer)
    d = json.loads(backend.to_str())
    v = d["model"]["vocab"]
    for name in FAMILY_TOKENS.get(family, ()):
        v.setdefault(name, len(v))
    i = 0
    while len(v) < vocab:
        name = f"<extra_{i}>"
        if name not in v:
            v[name] = len(v)
        i += 1
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)), bos_token=BOS, eos_token=EOT,
                                  pad_token=PAD, add_bos_token=True, chat_template=CHAT_TEMPLATE,
                                  model_max_length=model_max_length, padding_side="right")
    if len(tok) != vocab:  # pragma: no cover - a tokenizers change
        raise RuntimeError(f"padded tokenizer has {len(tok)} entries, expected {vocab}")
    return tok


# ------------------------------------------------------------------------------------------------ saved bases


def _complete(path: Path) -> Optional[dict]:
    try:
        info = json.loads((path / "build.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and "spec" in info else None


def _atomic_dir(final: Path, make) -> Path:
    """Build into a temporary sibling and move it into place (a concurrent build that won the race is kept)."""
    if _complete(final) is not None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        make(tmp)
        tmp.chmod(0o755)
        if final.exists() and _complete(final) is None:
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if _complete(final) is None:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def shape_dir(spec: ShapeSpec, cache_dir: Optional[Path] = None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "shapes" / f"{spec.name}-{spec.key()}"


def build_shape_base(spec: ShapeSpec, cache_dir: Optional[Path] = None) -> Path:
    """The saved shape (seeded random weights in `spec.dtype`, safetensors) and its padded tokenizer; cached."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    def make(tmp: Path) -> None:
        world = World.generate(seed=0, n_entities=64)
        tok = padded_tokenizer(world, spec.vocab, family=spec.family)
        cfg = shape_config(spec, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed)
                model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, spec.dtype))
            model.generation_config.eos_token_id = tok.eos_token_id
            model.generation_config.pad_token_id = tok.pad_token_id
            model.generation_config.do_sample = False
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        n = sum(p.numel() for p in model.parameters())
        (tmp / "build.json").write_text(json.dumps({"spec": dataclasses.asdict(spec), "key": spec.key(),
                                                    "n_parameters": n, "vocab_size": len(tok)}, indent=2) + "\n")

    return _atomic_dir(shape_dir(spec, cache_dir), make)


# ------------------------------------------------------------------------------------------------ runs


@dataclass(frozen=True)
class RunSpec:
    rows: int = 64
    items: int = 8
    lora_r: int = 16
    lora_b_std: float = 0.05
    # the base the eval answers are generated with: its quantization (none | nf4 | int8), device and dtype (a greedy
    # answer of bf16 on a GPU is not the fp32 CPU one, and the expected answer must be the base's own)
    quantization: str = "none"
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 4
    seed: int = 0

    def key(self, base: ShapeSpec) -> str:
        run = dataclasses.asdict(self)
        for k, default in (("device", "cpu"), ("dtype", "float32")):  # keys of CPU float32 runs from before them
            if run[k] == default:
                run.pop(k)
        payload = json.dumps({"run": run, "base": base.key(), "code": SHAPES_CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def shape_run(spec: ShapeSpec, run: RunSpec = RunSpec(), cache_dir: Optional[Path] = None) -> Path:
    """A cached run template on the saved shape: train.jsonl (`run.rows` chat rows of the demo world), adapter/
    (LoRA r `run.lora_r` on all 7 projections, B ~ N(0, lora_b_std), scaled up until the adapter changes enough greedy
    answers), eval.jsonl (`run.items` questions whose
    answer is the base's greedy answer, chosen among those the adapter answers otherwise). `write_shape_config`
    points a config at it."""
    base = build_shape_base(spec, cache_dir)

    def make(tmp: Path) -> None:
        from peft import get_peft_model

        from ..capability.evaluate import generate_answers
        from ..config import config_from_dict
        from ..setup.model import load_base, load_tokenizer
        from ..setup.records import load_eval

        world = World.generate(seed=0, n_entities=64)
        pairs = world.fact_pairs()
        qs = [(e, a, p) for p in range(world.n_phrasings) for (e, a) in pairs]
        train = [_chat(world.question(e, a, p), world.value(e, a)) for e, a, p in qs[: run.rows]]
        (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
        cfg = config_from_dict({"model": {"base": str(base), "device": run.device, "dtype": run.dtype,
                                          "quantization": run.quantization},
                                "data": {"train": str(tmp / "train.jsonl")}})
        tok = load_tokenizer(cfg)

        def draw_b(std: float) -> None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0.0, std)

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.seed + 1)  # the LoRA's A init and B draw: the same adapter on any base
            model = get_peft_model(load_base(cfg), lora_config(run.lora_r))
            draw_b(run.lora_b_std)
        model.eval()
        # candidates: other phrasings of the same facts, asked of the base and of the fine-tune
        cand = qs[run.rows : run.rows + 8 * run.items]
        (tmp / "cand.jsonl").write_text("".join(json.dumps({"prompt": world.question(e, a, p), "answer": "x"}) + "\n"
                                                for e, a, p in cand))
        items = load_eval(tmp / "cand.jsonl")
        kw = dict(chat=True, max_new_tokens=run.max_new_tokens, batch_size=16)
        with model.disable_adapter():
            base_ans = generate_answers(model, tok, items, desc="shape base answers", **kw)
        if sum(bool(b.strip()) for b in base_ans) < run.items:
            # a random model's greedy pick is often one token for every prompt: white space or an end of turn here
            raise RuntimeError(f"the base answers only {sum(bool(b.strip()) for b in base_ans)} of {len(items)} "
                               f"questions with text; build the shape with another ShapeSpec.seed (now {spec.seed})")
        # A small or low-precision model may need a larger B before the adapter changes its greedy answers: the
        # scale grows by 4x per attempt (each a seeded draw), the first that changes enough answers is kept.
        for attempt, mult in enumerate((1, 4, 16, 64)):
            std = run.lora_b_std * mult
            if attempt:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(run.seed + 1 + attempt)
                    draw_b(std)
            tuned_ans = generate_answers(model, tok, items, desc="shape tuned answers", **kw)
            keep = [(it, b) for it, b, t in zip(items, base_ans, tuned_ans) if b.strip() and b.strip() != t.strip()]
            if len(keep) >= run.items:
                break
        else:
            raise RuntimeError(f"only {len(keep)} of {len(items)} questions are answered differently by the adapter "
                               f"at B std up to {std}")
        model.save_pretrained(tmp / "adapter")
        (tmp / "cand.jsonl").unlink()
        (tmp / "eval.jsonl").write_text("".join(json.dumps({"prompt": it.prompt, "answer": b}) + "\n"
                                                for it, b in keep[: run.items]))
        (tmp / "build.json").write_text(json.dumps({"spec": dataclasses.asdict(run), "base": str(base),
                                                    "shape": spec.name, "lora_b_std": std}, indent=2) + "\n")

    return _atomic_dir(shape_dir(spec, cache_dir) / "runs" / run.key(spec), make)


def write_shape_config(run_dir: Path, template: Path, *, extra: Optional[dict] = None) -> Path:
    """gradian.yaml in `run_dir` over a `shape_run` template (data, adapter and base from the cache; output here).
    Only what the run needs is set: every gradian default (grads.projection_dim: auto, ...) stays in force."""
    import yaml

    info = json.loads((Path(template) / "build.json").read_text())
    cfg = {"model": {"base": info["base"], "adapter": str(Path(template) / "adapter"),
                     "device": info["spec"].get("device", "cpu"), "dtype": info["spec"].get("dtype", "float32")},
           "data": {"train": str(Path(template) / "train.jsonl"), "eval": str(Path(template) / "eval.jsonl")},
           "evaluation": {"max_new_tokens": info["spec"]["max_new_tokens"]},
           "output": "out"}
    if info["spec"].get("quantization", "none") != "none":
        cfg["model"]["quantization"] = info["spec"]["quantization"]
    for section, values in (extra or {}).items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "gradian.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
