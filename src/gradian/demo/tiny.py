"""The built-in tiny model: a byte-level BPE tokenizer and a 2-layer Llama pretrained from scratch on a synthetic world.

`build_tiny_base()` returns a directory that loads the exact way a user's real model does:

    path = build_tiny_base()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)

The build is a pure function of `TinySpec` (seeded, one CPU thread, deterministic algorithms): two builds give
identical weights. The result is cached under `$GRADIAN_CACHE` (else `~/.cache/gradian`) in `tiny/<key>`, where
the key hashes the spec and `TINY_CODE_VERSION`; a build is written to a temporary directory and moved into place
with `os.replace`, and `build.json` (written last) marks it complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .world import World

__all__ = [
    "TINY_CODE_VERSION",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TinySpec",
    "build_tiny_base",
    "cache_root",
    "tiny_dir",
    "read_build_info",
    "build_tokenizer",
    "chat_prompt",
    "greedy_answers",
    "exact_match",
    "normalize_answer",
    "world_questions",
    "load_tiny",
]

# Bump whenever a change here alters the built tokenizer or weights: it is part of the cache key.
TINY_CODE_VERSION = "tiny-1"

PAD, BOS, EOT = "<|pad|>", "<|bos|>", "<|end|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, BOS, EOT, SYSTEM, USER, ASSISTANT)  # ids 0..5 in this order

# A turn is `<|role|>\n{content}<|end|>`; the assistant's content and its `<|end|>` sit inside the generation tags,
# so `return_assistant_tokens_mask=True` masks exactly the answer plus its end-of-turn token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] }}{{ '<|end|>' }}{% endgeneration %}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>' }}"
    "{% else %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines the tiny model. Changing any field gives another cache entry."""

    seed: int = 0
    n_entities: int = 64
    vocab_size: int = 1536  # an upper bound: the BPE trainer stops when no pair occurs twice (~1000 here)
    hidden_size: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention, as in Llama 3 / Qwen: k_proj and v_proj are narrower
    intermediate_size: int = 512
    max_position: int = 256
    epochs: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.1  # speeds up memorisation a lot here (0.85 -> 0.98 exact match at equal steps)
    batch_size: int = 64
    statements: bool = True  # also train on the plain fact statements as text
    target_exact_match: float = 0.98

    def key(self) -> str:
        payload = json.dumps({"spec": dataclasses.asdict(self), "code": TINY_CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------- cache paths
def cache_root() -> Path:
    env = os.environ.get("GRADIAN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gradian"


def tiny_dir(spec: TinySpec = TinySpec(), cache_dir: Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "tiny" / spec.key()


def read_build_info(path: Path) -> dict[str, Any] | None:
    """The build record of a complete tiny-model directory, or None when the directory is missing or incomplete."""
    f = Path(path) / "build.json"
    try:
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or "exact_match" not in info or "spec" not in info:
        return None
    return info


# ---------------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(world: World, vocab_size: int = 1536, model_max_length: int = 256):
    """A byte-level BPE tokenizer trained on the world's corpus, wrapped as a transformers fast tokenizer.

    It adds `<|bos|>` in front of plain text (as Llama tokenizers do; the chat template writes its own bos, and
    `apply_chat_template` does not add another), `<|end|>` is both the end-of-turn and the eos token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(world.corpus()), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        add_bos_token=True,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="right",
    )
    return tok


def chat_prompt(tok, question: str) -> list[int]:
    """Token ids of a one-turn user chat with the generation prompt."""
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    return list(ids)


def normalize_answer(s: str) -> str:
    """The design's exact-match normalisation: strip surrounding white space and one trailing period."""
    s = s.strip()
    if s.endswith("."):
        s = s[:-1]
    return s.strip()


@torch.no_grad()
def greedy_answers(
    model, tok, prompts: Sequence[str], max_new_tokens: int = 6, batch_size: int = 256
) -> list[str]:
    """Greedy answers to user questions, batched with left padding, decoded without special tokens."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    eot = tok.convert_tokens_to_ids(EOT) if EOT in tok.get_vocab() else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [chat_prompt(tok, q) for q in prompts[start : start + batch_size]]
        width = max(len(c) for c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, c in enumerate(chunk):
            ids[i, width - len(c) :] = torch.tensor(c)
            mask[i, width - len(c) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eot,
            pad_token_id=pad,
        )
        for row in gen[:, width:].tolist():
            if eot in row:
                row = row[: row.index(eot)]
            out.append(tok.decode(row, skip_special_tokens=True))
    if was_training:
        model.train()
    return out


def world_questions(world: World, phrasings: Sequence[int] | None = None) -> list[tuple[str, str]]:
    """(question, right answer) for every entity x attribute x phrasing, in a fixed order."""
    ps = range(world.n_phrasings) if phrasings is None else phrasings
    return [(world.question(e, a, p), world.value(e, a)) for e, a in world.fact_pairs() for p in ps]


def exact_match(model, tok, items: Sequence[tuple[str, str]], batch_size: int = 256) -> float:
    """Fraction of (question, answer) items the model answers exactly (greedy, normalised)."""
    if not items:
        return float("nan")
    got = greedy_answers(model, tok, [q for q, _ in items], batch_size=batch_size)
    hits = sum(normalize_answer(g) == normalize_answer(a) for g, (_, a) in zip(got, items))
    return hits / len(items)


# ---------------------------------------------------------------------------------------------------- pretraining
def _examples(world: World, tok, statements: bool) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) pairs: every question as a chat (loss on the answer and its end-of-turn token) and every
    fact statement as text (loss on every token but bos)."""
    rows: list[tuple[list[int], list[int]]] = []
    for e, a in world.fact_pairs():
        v = world.value(e, a)
        for p in range(world.n_phrasings):
            msgs = [{"role": "user", "content": world.question(e, a, p)}, {"role": "assistant", "content": v}]
            enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = list(enc["input_ids"])
            labels = [t if m else -100 for t, m in zip(ids, enc["assistant_masks"])]
            rows.append((ids, labels))
        if statements:
            for t in range(world.n_statement_templates):
                ids = list(tok(world.statement(e, a, template=t))["input_ids"]) + [tok.eos_token_id]
                rows.append((ids, [-100] + ids[1:]))
    return rows


def _batches(rows, batch_size: int, gen: torch.Generator, pad: int) -> Iterator[tuple[torch.Tensor, ...]]:
    order = torch.randperm(len(rows), generator=gen).tolist()
    for s in range(0, len(order), batch_size):
        chunk = [rows[i] for i in order[s : s + batch_size]]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (x, y) in enumerate(chunk):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
            mask[i, : len(x)] = 1
        yield ids, mask, labels


@contextlib.contextmanager
def _reproducible(seed: int):
    """One thread, deterministic algorithms, a forked RNG: the caller's settings are restored afterwards."""
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=det_warn)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]tiny model[/bold] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        disable=not enabled,
        transient=False,
    )


def _pretrain(spec: TinySpec, progress: bool) -> tuple[Any, Any, World, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    world = World.generate(seed=spec.seed, n_entities=spec.n_entities)
    tok = build_tokenizer(world, spec.vocab_size, spec.max_position)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        max_position_embeddings=spec.max_position,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attention_dropout=0.0,
    )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = LlamaForCausalLM(config)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.do_sample = False

    rows = _examples(world, tok, spec.statements)
    steps_per_epoch = math.ceil(len(rows) / spec.batch_size)
    total = steps_per_epoch * spec.epochs
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        t = (step - spec.warmup_steps) / max(1, total - spec.warmup_steps)
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(spec.seed)
    model.train()
    t0 = time.perf_counter()
    step = 0
    loss_ema = None
    with _progress(progress) as bar:
        task = bar.add_task("pretraining", total=total, status="")
        for epoch in range(spec.epochs):
            for ids, mask, labels in _batches(rows, spec.batch_size, gen, tok.pad_token_id):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
                bar.update(task, advance=1, status=f"epoch {epoch + 1}/{spec.epochs} loss {loss_ema:.3f}")
        train_s = time.perf_counter() - t0
        bar.update(task, description="measuring", status="greedy exact match on every question")
        model.eval()
        em = exact_match(model, tok, world_questions(world))
        bar.update(task, description="built", status=f"greedy exact match {em:.3f} on every question")
    info = {
        "spec": dataclasses.asdict(spec),
        "key": spec.key(),
        "code_version": TINY_CODE_VERSION,
        "exact_match": em,
        "n_questions": world.n_phrasings * len(world.fact_pairs()),
        "n_training_rows": len(rows),
        "steps": total,
        "final_loss": loss_ema,
        "train_seconds": round(train_s, 2),
        "eval_seconds": round(time.perf_counter() - t0 - train_s, 2),
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "torch": torch.__version__,
    }
    return model, tok, world, info


# ---------------------------------------------------------------------------------------------------- build + cache
def build_tiny_base(spec: TinySpec = TinySpec(), cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Build (or reuse) the tiny base model and return its directory.

    The directory holds `config.json`, `model.safetensors`, `generation_config.json`, the tokenizer files
    (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) and `build.json` with the spec and the
    greedy exact match measured on every question of the world.
    """
    final = tiny_dir(spec, cache_dir)
    if read_build_info(final) is not None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        t0 = time.process_time()
        w0 = time.perf_counter()
        with _reproducible(spec.seed):
            model, tok, _world, info = _pretrain(spec, progress)
        info["build_cpu_seconds"] = round(time.process_time() - t0, 2)
        info["build_wall_seconds"] = round(time.perf_counter() - w0, 2)
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Writing model shards" would print a tqdm bar for one tiny file
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        (tmp / "build.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache entry is an ordinary directory
        if info["exact_match"] < spec.target_exact_match:
            import warnings

            warnings.warn(
                f"tiny model reached exact match {info['exact_match']:.3f} < target {spec.target_exact_match}",
                stacklevel=2,
            )
        if final.exists() and read_build_info(final) is None:
            shutil.rmtree(final, ignore_errors=True)  # a foreign or broken leftover
        try:
            os.replace(tmp, final)
        except OSError:
            if read_build_info(final) is None:  # not a concurrent build that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_tiny(spec: TinySpec = TinySpec(), cache_dir: Path | None = None, progress: bool = True):
    """(model, tokenizer, world, build info), loaded through the Auto classes from the cached build."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_base(spec, cache_dir, progress)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    info = read_build_info(path)
    world = World.generate(seed=spec.seed, n_entities=spec.n_entities)
    return model, tok, world, info
