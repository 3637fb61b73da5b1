"""`gradian diagnose`: a registry of setup checks with stable ids, and the same checks before attribution.

Each check is a function registered with `@check(id, level, meaning=..., fix=...)`. It receives a `Context` that
loads what the checks need lazily and at most once (the data files, the tokenizer, the base model's config, the
adapter config, the model), and returns `passed(...)` or `failed(...)`. When a resource a check needs did not
load, the check that owns that failure reports it and every other check that needs it is skipped with the reason.
Nothing here builds an index or runs the model.

Calling the checks from code:

    results = run_diagnose("gradian.yaml", ["grads.batch_size=4"])    # what `gradian diagnose` prints
    results = run_checks_for_session(session)  # after api.open_session: raises CheckFailed on an error check and
                                               # puts the failed warnings/infos into session.flags (report flags)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .config import Config, load_config
from .errors import CheckFailed, ConfigError, DataError, GradianError, ModelError

LEVELS = ("error", "warning", "info")
STATUSES = ("pass", "fail", "skip")

# evaluation.small_eval_set fails when the eval set cannot detect a delta smaller than this.
SMALL_EVAL_MDD = 0.2
# adapter.base_mismatch compares the recorded base fingerprint only when the base's weights are at most this big.
FINGERPRINT_MAX_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    id: str
    level: str  # error | warning | info
    status: str  # pass | fail | skip
    message: str
    fix: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "level": self.level, "status": self.status, "message": self.message, "fix": self.fix}


@dataclass
class Outcome:
    status: str
    message: str
    fix: Optional[str] = None
    level: Optional[str] = None


def passed(message: str) -> Outcome:
    return Outcome("pass", message)


def failed(message: str, fix: Optional[str] = None, level: Optional[str] = None) -> Outcome:
    """A failed check. `fix` defaults to the registered fix; `level` overrides the registered level."""
    return Outcome("fail", message, fix, level)


def skipped(reason: str) -> Outcome:
    return Outcome("skip", reason)


class Unavailable(Exception):
    """A resource did not load. `owner` is the check that reports why; the others skip."""

    def __init__(self, owner: str, message: str, fix: Optional[str] = None, what: str = "", level: Optional[str] = None):
        super().__init__(message)
        self.owner, self.message, self.fix, self.what, self.level = owner, message, fix, what, level


# ------------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Check:
    id: str
    level: str
    meaning: str
    fix: str
    fn: Callable[["Context"], Outcome]


REGISTRY: dict[str, Check] = {}


def check(id: str, level: str, *, meaning: str, fix: str):
    """Register a check. Ids are stable: they appear in `diagnose --json`, report.json flags and the README."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}")

    def deco(fn: Callable[["Context"], Outcome]):
        if id in REGISTRY:
            raise ValueError(f"check id {id!r} registered twice")
        REGISTRY[id] = Check(id, level, meaning, fix, fn)
        return fn

    return deco


def run_checks(ctx: "Context", ids: Optional[list[str]] = None) -> list[CheckResult]:
    """Run the registered checks (all, or `ids`) in registration order."""
    out = []
    for c in REGISTRY.values():
        if ids is not None and c.id not in ids:
            continue
        try:
            o = c.fn(ctx)
        except Unavailable as u:
            if u.owner == c.id:
                o = failed(u.message, u.fix, u.level)
            else:
                what = f" ({u.what})" if u.what else ""
                o = skipped(f"skipped: a prerequisite did not load{what}; see {u.owner}")
        except GradianError as e:  # a loader this check called directly
            o = failed(str(e))
        if o.status == "skip" and not o.message.startswith("skipped"):
            o.message = "skipped: " + o.message
        out.append(CheckResult(
            c.id, o.level or c.level, o.status, o.message, (o.fix if o.fix is not None else c.fix) if o.status == "fail" else "",
        ))
    return out


# ------------------------------------------------------------------------------------------------- context


def _short(e: BaseException, n: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 1] + "…"


_LABELS = {
    "train_path": "data.train", "eval_path": "data.eval", "train_rows": "the training file",
    "eval_rows": "the eval file", "examples": "the training records", "eval_items": "the eval records",
    "tokenizer": "the tokenizer", "base_config": "the base model config", "causal": "a causal-LM base",
    "adapter_path": "the adapter directory", "adapter_config": "adapter_config.json", "lora": "a LoRA CAUSAL_LM adapter",
    "device": "the device", "base_model": "the base model weights", "model": "the base with its adapter",
    "sites": "LoRA sites", "toks": "the tokenized training rows",
}


class Context:
    """What the checks look at, loaded lazily and at most once; failures are remembered as `Unavailable`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._memo: dict[str, tuple[Any, Optional[Unavailable]]] = {}

    @classmethod
    def from_session(cls, s) -> "Context":
        """Reuse what `api.open_session` already loaded (data, tokenizer, model, sites)."""
        ctx = cls(s.cfg)
        m = ctx._memo
        m["train_path"] = (s.cfg.path(s.cfg.data.train), None)
        m["train_rows"] = ([(e.record, e.source) for e in s.examples], None)
        m["train_parse"] = ((s.examples, [], []), None)
        m["examples"] = (s.examples, None)
        if s.eval_items is not None:
            m["eval_path"] = (s.cfg.path(s.cfg.data.eval), None)
            m["eval_rows"] = ([({}, it.source) for it in s.eval_items], None)
            m["eval_parse"] = ((s.eval_items, None), None)
        m["tokenizer"] = (s.tokenizer, None)
        m["adapter_path"] = (s.adapter_path, None)
        m["model"] = (s.model, None)
        m["base_model"] = (s.model, None)
        m["sites"] = ((s.sites, s.skipped), None)
        ctx._toks_from = s  # Session.toks is cached there and reused by the index
        return ctx

    def _get(self, name: str, make: Callable[[], Any]) -> Any:
        if name not in self._memo:
            try:
                self._memo[name] = (make(), None)
            except Unavailable as u:
                if not u.what:
                    u.what = _LABELS.get(name, name)
                self._memo[name] = (None, u)
            except GradianError as e:
                self._memo[name] = (None, Unavailable("config.paths" if isinstance(e, ConfigError) else "model.load_failed",
                                                      str(e), what=_LABELS.get(name, name)))
        val, err = self._memo[name]
        if err is not None:
            raise err
        return val

    def peek(self, name: str) -> Any:
        """A resource if it already loaded, else None (never loads)."""
        val, err = self._memo.get(name, (None, None))
        return None if err else val

    # ------------------------------------------------------------------ paths and data

    @property
    def train_path(self) -> Path:
        def make():
            p = self.cfg.path(self.cfg.data.train)
            if not p.exists():
                raise Unavailable("config.paths", f"data.train: {p} not found")
            return p
        return self._get("train_path", make)

    @property
    def eval_path(self) -> Optional[Path]:
        def make():
            if not self.cfg.data.eval:
                return None
            p = self.cfg.path(self.cfg.data.eval)
            if not p.exists():
                raise Unavailable("config.paths", f"data.eval: {p} not found")
            return p
        return self._get("eval_path", make)

    def _rows(self, path: Path):
        from .data import _read_records

        try:
            return _read_records(path)
        except DataError as e:
            raise Unavailable("data.unreadable_record", str(e)) from None

    @property
    def train_rows(self) -> list:
        return self._get("train_rows", lambda: self._rows(self.train_path))

    @property
    def eval_rows(self) -> Optional[list]:
        return self._get("eval_rows", lambda: None if self.eval_path is None else self._rows(self.eval_path))

    @property
    def train_parse(self) -> tuple[list, list[str], list[str]]:
        """(examples, unknown-shape messages, invalid-record messages) over every training record."""
        def make():
            from .data import Example, content_hash, train_shape

            examples, unknown, invalid = [], [], []
            for pos, (rec, where) in enumerate(self.train_rows):
                try:
                    shape, clean = train_shape(rec, where)
                except DataError as e:
                    msg = str(e)
                    (unknown if ("unknown record shape" in msg or "expected a JSON object" in msg) else invalid).append(msg)
                    continue
                examples.append(Example(id=f"train-{pos:06d}-{content_hash(clean)}", position=pos, shape=shape,
                                        record=clean, source=where))
            return examples, unknown, invalid
        return self._get("train_parse", make)

    @property
    def examples(self) -> list:
        def make():
            rows = self.train_rows
            if not rows:
                raise Unavailable("data.empty", f"{self.train_path}: no records; the training set is empty")
            ex, unknown, invalid = self.train_parse
            if unknown:
                raise Unavailable("data.unknown_record_shape", unknown[0])
            if invalid:
                raise Unavailable("data.invalid_record", invalid[0])
            return ex
        return self._get("examples", make)

    @property
    def eval_parse(self) -> tuple[Optional[list], Optional[tuple[str, str]]]:
        """(eval items, None) or (None, (check id, message)) for the first bad eval record."""
        def make():
            from .data import load_eval

            if self.eval_rows is None or not self.eval_rows:
                return None, None
            try:
                return load_eval(self.eval_path), None
            except DataError as e:
                msg = str(e)
                shape = any(s in msg for s in ("need a string 'answer'", "need 'prompt' or 'messages'", "expected a JSON object"))
                return None, ("data.unknown_record_shape" if shape else "data.invalid_record", msg)
        return self._get("eval_parse", make)

    @property
    def eval_items(self) -> Optional[list]:
        def make():
            if self.eval_rows is None:
                return None
            if not self.eval_rows:
                raise Unavailable("data.empty", f"{self.eval_path}: no records; the eval set is empty")
            items, problem = self.eval_parse
            if problem:
                raise Unavailable(problem[0], problem[1])
            return items
        return self._get("eval_items", make)

    # ------------------------------------------------------------------ tokenizer, model, adapter

    @property
    def base_ref(self) -> str:
        return self._get("base_ref", lambda: self.cfg.local_or_hub(self.cfg.model.base, "model.base"))

    @property
    def tokenizer(self):
        def make():
            from .modeling import load_tokenizer

            self.base_ref
            try:
                return _quiet(load_tokenizer, self.cfg)
            except ModelError as e:
                raise Unavailable("tokenizer.load_failed", str(e)) from None
        return self._get("tokenizer", make)

    @property
    def base_config(self):
        def make():
            from transformers import AutoConfig

            base = self.base_ref
            p = Path(base)
            if p.is_dir() and not (p / "config.json").exists():
                if (p / "adapter_config.json").exists():
                    raise Unavailable("model.load_failed", f"model.base '{base}' is a LoRA adapter directory, not a model; "
                                      "set model.base to the model it was trained on and model.adapter to this directory")
                raise Unavailable("model.load_failed", f"model.base '{base}': no config.json in this directory")
            try:
                return _quiet(AutoConfig.from_pretrained, base, trust_remote_code=self.cfg.model.trust_remote_code)
            except Exception as e:
                raise Unavailable("model.load_failed", f"model.base '{base}': cannot read a model config ({_short(e)})") from None
        return self._get("base_config", make)

    @property
    def causal(self) -> bool:
        def make():
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            mcfg = self.base_config
            base = self.base_ref
            if type(mcfg) not in MODEL_FOR_CAUSAL_LM_MAPPING and not self.cfg.model.trust_remote_code:
                raise Unavailable("model.not_causal_lm", f"model.base '{base}': {type(mcfg).__name__} "
                                  f"(model_type '{getattr(mcfg, 'model_type', '?')}') is not a causal LM architecture")
            archs = getattr(mcfg, "architectures", None) or []
            if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
                raise Unavailable("model.not_causal_lm", f"model.base '{base}': config.json architectures {archs} are not "
                                  "causal LM heads (a sequence-classification or encoder checkpoint)")
            return True
        return self._get("causal", make)

    @property
    def adapter_path(self) -> str:
        def make():
            value = self.cfg.model.adapter
            if value is None:
                raise Unavailable("model.full_finetune", "model.adapter is not set: there is no LoRA adapter to attribute over")
            ref = self.cfg.local_or_hub(value, "model.adapter")
            p = Path(ref)
            if p.exists() and not p.is_dir():
                raise Unavailable("model.full_finetune", f"model.adapter '{value}': {p} is a file; it must be a PEFT adapter "
                                  "directory (adapter_config.json + adapter_model.safetensors)")
            if p.is_dir() and not (p / "adapter_config.json").exists() and (p / "config.json").exists():
                raise Unavailable("model.full_finetune", f"model.adapter '{value}': {p} holds a full model (config.json, no "
                                  "adapter_config.json): a full fine-tune has no LoRA adapter to attribute over")
            return ref
        return self._get("adapter_path", make)

    @property
    def adapter_config(self) -> dict:
        def make():
            ref = self.adapter_path
            p = Path(ref)
            if p.is_dir():
                f = p / "adapter_config.json"
                if not f.exists():
                    raise Unavailable("adapter.unreadable", f"{p}: no adapter_config.json; model.adapter must be a PEFT "
                                      "LoRA adapter directory")
            else:
                try:
                    from huggingface_hub import hf_hub_download

                    f = Path(hf_hub_download(ref, "adapter_config.json"))
                except Exception as e:
                    raise Unavailable("adapter.unreadable", f"model.adapter '{ref}': not a local directory and not "
                                      f"loadable from the hub ({_short(e)})") from None
            try:
                d = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise Unavailable("adapter.unreadable", f"{f}: unreadable adapter config ({_short(e)})") from None
            if not isinstance(d, dict):
                raise Unavailable("adapter.unreadable", f"{f}: expected a JSON object, got {type(d).__name__}")
            d["__file__"] = str(f)
            return d
        return self._get("adapter_config", make)

    @property
    def lora(self) -> bool:
        def make():
            d = self.adapter_config
            f = d["__file__"]
            if d.get("peft_type") not in (None, "LORA"):
                raise Unavailable("adapter.not_lora", f"{f}: peft_type is {d.get('peft_type')!r}, not LORA")
            if d.get("task_type") not in (None, "CAUSAL_LM"):
                raise Unavailable("adapter.task_type", f"{f}: task_type is {d.get('task_type')!r}, not CAUSAL_LM")
            return True
        return self._get("lora", make)

    @property
    def device(self):
        def make():
            from .runtime import resolve_device

            try:
                return resolve_device(self.cfg.model.device)
            except ModelError as e:
                raise Unavailable("device.unavailable", str(e)) from None
        return self._get("device", make)

    @property
    def base_model(self):
        def make():
            from .modeling import load_base

            self.causal
            device = self.device
            try:
                return _quiet(load_base, self.cfg, device)
            except ModelError as e:
                raise Unavailable("model.load_failed", _short(e, 600)) from None
        return self._get("base_model", make)

    @property
    def model(self):
        def make():
            from peft import PeftModel

            from .modeling import summarize_load_error

            self.lora
            path = self.adapter_path
            base = self.base_model
            try:
                model = _quiet(PeftModel.from_pretrained, base, path, is_trainable=True)
            except Exception as e:
                raise Unavailable("adapter.base_mismatch", f"model.adapter '{path}' does not fit model.base "
                                  f"'{self.base_ref}': {summarize_load_error(e)}") from None
            model.eval()
            for n, p in model.named_parameters():
                p.requires_grad_("lora_" in n)
            return model
        return self._get("model", make)

    @property
    def sites(self) -> tuple[list, list[str]]:
        def make():
            from .modeling import lora_sites

            sites, skipped_ = lora_sites(self.model, self.cfg.grads.module_filter)
            if not sites:
                what = f" matching grads.module_filter {self.cfg.grads.module_filter}" if self.cfg.grads.module_filter else ""
                raise Unavailable("adapter.skipped_modules", f"model.adapter '{self.adapter_path}': no LoRA Linear sites{what} "
                                  "to capture gradients on" + (f" (skipped: {', '.join(skipped_[:5])})" if skipped_ else ""),
                                  fix="target Linear layers (q_proj, v_proj, ...) when training the adapter"
                                  + ("; or widen grads.module_filter" if what else ""), level="error")
            return sites, skipped_
        return self._get("sites", make)

    @property
    def toks(self) -> list:
        def make():
            from .data import tokenize_example

            s = getattr(self, "_toks_from", None)
            examples = self.examples
            tok = self.tokenizer
            if s is not None:
                try:
                    return s.toks
                except DataError as e:
                    raise Unavailable("data.tokenize_failed", str(e)) from None
            out = []
            for ex in examples:
                try:
                    out.append(tokenize_example(tok, ex, self.cfg.grads.max_seq_length))
                except Exception as e:  # DataError, or a chat template that raises (jinja2) on this record
                    if not isinstance(e, (DataError, ValueError, TypeError, KeyError)) and "jinja2" not in type(e).__module__:
                        raise
                    msg = str(e)
                    if ex.source and ex.source not in msg:
                        msg = f"{ex.source}: {msg}"
                    raise Unavailable("data.tokenize_failed", msg) from None
            return out
        return self._get("toks", make)


def _quiet(fn, *args, **kwargs):
    """Call a transformers/PEFT loader without its progress bars and info chatter."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return fn(*args, **kwargs)
    import warnings

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# ------------------------------------------------------------------------------------------------- helpers


def _blocking_file(p: Path) -> Optional[Path]:
    """The existing non-directory at or above p that would stop `mkdir -p p`, if any."""
    for q in [p, *p.parents]:
        if q.exists():
            return None if q.is_dir() else q
    return None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _mem_available() -> Optional[int]:
    """Bytes of memory available to a new allocation on this host (MemAvailable), without psutil."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None


def _free_memory(device) -> tuple[Optional[int], str]:
    import torch

    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free), f"free on {device}"
        except Exception:  # pragma: no cover - driver trouble
            return None, str(device)
    if device.type == "cpu":
        return _mem_available(), "available host memory"
    return None, str(device)


def _text_config(mcfg):
    get = getattr(mcfg, "get_text_config", None)
    try:
        return get() if get else mcfg
    except Exception:  # pragma: no cover
        return mcfg


def _vocab_rows(mcfg) -> Optional[int]:
    v = getattr(_text_config(mcfg), "vocab_size", None)
    return int(v) if isinstance(v, int) else None


def _param_estimate(mcfg) -> Optional[int]:
    """Parameters of a Llama-like decoder from its config (embeddings, attention with GQA, gated MLP)."""
    c = _text_config(mcfg)
    try:
        h, L, V = int(c.hidden_size), int(c.num_hidden_layers), int(c.vocab_size)
    except (AttributeError, TypeError, ValueError):
        return None
    nh = int(getattr(c, "num_attention_heads", None) or max(h // 64, 1))
    kv = int(getattr(c, "num_key_value_heads", None) or nh)
    hd = int(getattr(c, "head_dim", None) or h // nh)
    inter = int(getattr(c, "intermediate_size", None) or 4 * h)
    attn = 2 * h * nh * hd + 2 * h * kv * hd
    mlp = 3 * h * inter
    emb = V * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return emb + L * (attn + mlp)


def _dtype_bytes(cfg: Config, mcfg=None) -> int:
    name = cfg.model.dtype
    if name == "auto" and mcfg is not None:
        name = str(getattr(mcfg, "dtype", None) or getattr(mcfg, "torch_dtype", None) or "float32")
    return 2 if ("16" in name) else 4


def _quant_bits(qc: Any) -> tuple[Optional[int], str]:
    if qc is None:
        return None, ""
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "quantized"))
    if qc.get("load_in_4bit"):
        return 4, method
    if qc.get("load_in_8bit"):
        return 8, method
    bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
    return (int(bits) if isinstance(bits, (int, float)) else 4), method


_QUANT_NAME = re.compile(r"(?i)(bnb[-_]?4bit|bnb[-_]?8bit|[-_.]4bit|[-_.]8bit|gptq|awq|[-_]int4|[-_]int8|nf4)")


def _same_model_ref(a: str, b: str, root: Optional[str]) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if root is not None:
        pa = pa if pa.is_absolute() else Path(root) / pa
    if pa.exists() and pb.exists():
        try:
            return pa.resolve() == pb.resolve()
        except OSError:  # pragma: no cover
            return False
    # A hub id against a local copy of it: compare the last path component ("Llama-3.1-8B").
    return Path(a.rstrip("/")).name.lower() == Path(b.rstrip("/")).name.lower()


def _weights_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file() and f.suffix in {".safetensors", ".bin"})


# ================================================================================================= the checks
# Registration order is the order `diagnose` prints: configuration, runtime, data, tokenizer, model, adapter,
# evaluation, resources.


@check("config.paths", "error",
       meaning="A path in the config (data.train, data.eval, model.base, model.adapter, "
               "attribution.checkpoint_adapters, output, grads.cache_dir, train.output) is missing, or an output "
               "location is blocked by a file.",
       fix="fix the path in the config; relative paths resolve against the config file's directory")
def _config_paths(ctx: Context) -> Outcome:
    cfg = ctx.cfg
    problems = []
    for key, value in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if value and not cfg.path(value).exists():
            problems.append(f"{key}: {cfg.path(value)} not found")
    for key, value in (("model.base", cfg.model.base), ("model.adapter", cfg.model.adapter)):
        try:
            cfg.local_or_hub(value, key)
        except ConfigError as e:
            problems.append(str(e))
    for i, a in enumerate(cfg.attribution.checkpoint_adapters):
        p = cfg.path(a)
        if p is None or not (p / "adapter_config.json").exists():
            problems.append(f"attribution.checkpoint_adapters[{i}]: {p} is not an adapter directory (no "
                            "adapter_config.json)")
    for key, p in (("output", cfg.output_dir), ("grads.cache_dir", cfg.index_dir), ("train.output", cfg.adapter_out)):
        blocker = _blocking_file(p)
        if blocker is not None:
            problems.append(f"{key}: {blocker} is a file, so the directory {p} cannot be created")
    if problems:
        return failed("; ".join(problems))
    where = f" (relative to {cfg.root})" if cfg.root else ""
    return passed(f"data, model and output paths resolve{where}")


@check("device.unavailable", "error",
       meaning="model.device names a device this machine does not have (cuda without CUDA, mps without MPS).",
       fix="set model.device: auto (CUDA when present, else CPU) or cpu")
def _device_unavailable(ctx: Context) -> Outcome:
    d = ctx.device
    return passed(f"model.device '{ctx.cfg.model.device}' resolves to {d}")


@check("device.mps_not_auto", "info",
       meaning="An Apple GPU (MPS) is present but model.device is auto, which picks CPU: MPS kernels are not "
               "deterministic enough to be a default.",
       fix="set model.device: mps to use the Apple GPU (runs are then not bit-reproducible)")
def _device_mps(ctx: Context) -> Outcome:
    import torch

    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if ctx.cfg.model.device == "auto" and mps and not torch.cuda.is_available():
        return failed("model.device is 'auto' and this machine has MPS: gradian runs on the CPU unless model.device "
                      "is 'mps'")
    return passed(f"model.device '{ctx.cfg.model.device}'" + (" (MPS present)" if mps else ""))


@check("runtime.threads", "warning",
       meaning="More torch CPU threads than the cores can serve: on 1-2 (shared) cores OpenMP spin-waits make each "
               "step many times slower.",
       fix="set model.threads: 1 (or GRADIAN_THREADS=1); use more threads only with as many free cores")
def _runtime_threads(ctx: Context) -> Outcome:
    env = os.environ.get("GRADIAN_THREADS")
    if ctx.cfg.model.threads:
        n, src = ctx.cfg.model.threads, "model.threads"
    elif env:
        try:
            n, src = int(env), "GRADIAN_THREADS"
        except ValueError:
            return failed(f"GRADIAN_THREADS={env!r} is not an integer", "unset GRADIAN_THREADS or set it to a number",
                          level="error")
        if n < 1:
            return failed(f"GRADIAN_THREADS={env!r} must be at least 1", "unset GRADIAN_THREADS or set it to 1",
                          level="error")
    else:
        n, src = 1, "default"
    cores = _cpu_count()
    if (n > 1 and cores <= 2) or n > cores:
        return failed(f"{src} = {n} torch threads on {cores} CPU core(s)")
    return passed(f"{n} torch thread(s) ({src}) on {cores} CPU core(s)")


@check("data.unreadable_record", "error",
       meaning="A data file cannot be read as records: invalid JSON, non-UTF-8 bytes, an over-long line, an "
               "unsupported file type or a directory that is not a save_to_disk dataset. The message names file:line.",
       fix="repair the record at the named file:line (one JSON object per line, UTF-8)")
def _data_unreadable(ctx: Context) -> Outcome:
    problems, notes, missing = [], [], []
    for key, rows, u in _both_files(ctx):
        if u is not None:
            (problems if u.owner == "data.unreadable_record" else missing).append(
                u.message if u.owner == "data.unreadable_record" else f"{key} ({u.owner})")
        elif rows is not None:
            notes.append(f"{key}: {len(rows)} records")
    if problems:
        return failed("; ".join(problems))
    if missing and not notes:
        return skipped(f"{', '.join(missing)} did not load")
    return passed(", ".join(notes))


def _both_files(ctx: Context):
    """(key, rows or None, Unavailable or None) for data.train and data.eval."""
    for key, get in (("data.train", lambda: ctx.train_rows), ("data.eval", lambda: ctx.eval_rows)):
        try:
            yield key, get(), None
        except Unavailable as u:
            yield key, None, u


@check("data.empty", "error",
       meaning="The training (or eval) file holds no records.",
       fix="point data.train / data.eval at a file with records")
def _data_empty(ctx: Context) -> Outcome:
    msgs, ok, missing = [], [], []
    for key, rows, u in _both_files(ctx):
        if u is not None:
            missing.append(f"{key} ({u.owner})")
        elif rows is not None and not rows:
            msgs.append(f"{ctx.train_path if key == 'data.train' else ctx.eval_path}: no records ({key} is empty)")
        elif rows is not None:
            ok.append(f"{key}: {len(rows)}")
    if msgs:
        return failed("; ".join(msgs))
    if missing and not ok:
        return skipped(f"{', '.join(missing)} did not load")
    return passed("records: " + ", ".join(ok))


@check("data.unknown_record_shape", "error",
       meaning="A record matches none of the known shapes: train {messages}, {prompt, completion} or {text}; eval "
               "{prompt, answer} or {messages, answer}.",
       fix="rename the fields to one of the supported shapes (see README 'Data records')")
def _data_unknown_shape(ctx: Context) -> Outcome:
    _, unknown, _ = ctx.train_parse
    msgs = list(unknown)
    if ctx.eval_rows:
        _, problem = ctx.eval_parse
        if problem and problem[0] == "data.unknown_record_shape":
            msgs.append(problem[1])
    if msgs:
        more = f" (and {len(msgs) - 3} more)" if len(msgs) > 3 else ""
        return failed(f"{len(msgs)} record(s) with an unknown shape: " + "; ".join(msgs[:3]) + more)
    return passed("every record has a known shape")


@check("data.invalid_record", "error",
       meaning="A record has a known shape but a bad field: a non-string content, an unknown role, a conversation "
               "without an assistant turn, an eval conversation that ends with the answer.",
       fix="repair the field named at file:line, or drop the record")
def _data_invalid(ctx: Context) -> Outcome:
    _, _, invalid = ctx.train_parse
    msgs = list(invalid)
    if ctx.eval_rows:
        _, problem = ctx.eval_parse
        if problem and problem[0] == "data.invalid_record":
            msgs.append(problem[1])
    if msgs:
        more = f" (and {len(msgs) - 3} more)" if len(msgs) > 3 else ""
        return failed(f"{len(msgs)} malformed record(s): " + "; ".join(msgs[:3]) + more)
    return passed("every record is well formed")


@check("data.duplicate_rows", "warning",
       meaning="Some training records are exact copies of earlier ones: copies share one gradient, rank together, "
               "and a removal test must drop every copy.",
       fix="deduplicate data.train, or read copies of a row as one row (drop all of them in verify)")
def _data_duplicates(ctx: Context) -> Outcome:
    first: dict[str, Any] = {}
    dups = []
    for e in ctx.examples:
        h = e.id.rsplit("-", 1)[-1]
        if h in first:
            dups.append((e, first[h]))
        else:
            first[h] = e
    if dups:
        ex = ", ".join(f"{e.source or e.position} repeats {o.source or o.position}" for e, o in dups[:3])
        return failed(f"{len(dups)} of {len(ctx.examples)} training rows repeat an earlier row exactly ({ex})")
    return passed(f"{len(ctx.examples)} distinct training rows")


@check("tokenizer.load_failed", "error",
       meaning="No tokenizer loads from model.base.",
       fix="save the tokenizer next to the model (tokenizer.save_pretrained(model.base))")
def _tokenizer_load(ctx: Context) -> Outcome:
    tok = ctx.tokenizer
    return passed(f"{type(tok).__name__} with {len(tok)} tokens from model.base '{ctx.cfg.model.base}'")


@check("data.no_chat_template", "warning",
       meaning="The tokenizer has no chat template: conversations are rendered as 'role: content' lines and whole "
               "sequences are supervised. Info for text-only data, a warning otherwise.",
       fix="use the tokenizer the model was fine-tuned with, with a chat template (ideally with {% generation %} tags)")
def _no_chat_template(ctx: Context) -> Outcome:
    from .data import has_chat_template

    tok = ctx.tokenizer
    if has_chat_template(tok):
        return passed(f"the tokenizer of '{ctx.cfg.model.base}' has a chat template")
    try:
        examples = ctx.examples
        text_only = bool(examples) and all(e.shape == "text" for e in examples)
    except Unavailable:
        text_only = False
    return failed(f"the tokenizer of model.base '{ctx.cfg.model.base}' has no chat_template"
                  + (": fine for text records" if text_only else
                     ": chats are rendered as 'role: content' lines and every token is supervised"),
                  level="info" if text_only else "warning")


@check("data.tokenize_failed", "error",
       meaning="A record cannot be rendered by the chat template (a role the template rejects, a template that is "
               "not prefix-stable) or tokenized.",
       fix="drop or rewrite the record, or use a chat template that accepts it")
def _tokenize_failed(ctx: Context) -> Outcome:
    toks = ctx.toks
    return passed(f"{len(toks)} rows tokenized (grads.max_seq_length {ctx.cfg.grads.max_seq_length})")


@check("data.no_supervised_tokens", "warning",
       meaning="Rows whose supervised tokens (the completion or assistant turns) vanish after truncation to "
               "grads.max_seq_length: their gradient is zero and they can never be accused. An error when every row "
               "is affected.",
       fix="raise grads.max_seq_length, or shorten the prompts of those rows")
def _no_supervised(ctx: Context) -> Outcome:
    toks, examples = ctx.toks, ctx.examples
    empty = [e for e, t in zip(examples, toks) if t.n_supervised == 0]
    L = ctx.cfg.grads.max_seq_length
    if empty:
        first = ", ".join(f"{e.id} ({e.source})" if e.source else e.id for e in empty[:3])
        return failed(f"{len(empty)} of {len(examples)} training rows have no supervised tokens after truncation to "
                      f"grads.max_seq_length={L} (first: {first})", level="error" if len(empty) == len(examples) else None)
    n_trunc = sum(t.truncated for t in toks)
    return passed(f"every row keeps supervised tokens at grads.max_seq_length={L}"
                  + (f" ({n_trunc} rows truncated)" if n_trunc else ""))


@check("model.context_length", "warning",
       meaning="Some tokenized rows (after truncation to grads.max_seq_length) are longer than the model's context "
               "(max_position_embeddings): out of distribution for rotary models, an indexing crash for models with "
               "learned positions (then an error).",
       fix="set grads.max_seq_length to at most the model's max_position_embeddings")
def _context_length(ctx: Context) -> Outcome:
    c = _text_config(ctx.base_config)
    limit = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
    if not isinstance(limit, int):
        return skipped("the model config gives no max_position_embeddings")
    toks, examples = ctx.toks, ctx.examples
    long = [(len(t.input_ids), e) for t, e in zip(toks, examples) if len(t.input_ids) > limit]
    if not long:
        return passed(f"the longest row has {max((len(t.input_ids) for t in toks), default=0)} tokens; the model's "
                      f"context is {limit}")
    n, e = max(long, key=lambda x: x[0])
    learned = hasattr(c, "n_positions") or getattr(c, "position_embedding_type", None) == "absolute"
    return failed(f"{len(long)} rows are longer than the model's context of {limit} tokens (max_position_embeddings) at "
                  f"grads.max_seq_length={ctx.cfg.grads.max_seq_length}; the longest has {n} tokens "
                  f"({e.source or e.id})", level="error" if learned else None)


@check("model.load_failed", "error",
       meaning="model.base cannot be loaded: no config.json, an adapter directory given as the base, broken or "
               "missing weights, an unavailable hub id.",
       fix="point model.base at a saved transformers model directory (config.json + weights) or a hub id")
def _model_load(ctx: Context) -> Outcome:
    mcfg = ctx.base_config
    try:
        ctx.causal
    except Unavailable:
        return skipped("the base is not a causal LM; see model.not_causal_lm")
    m = ctx.base_model
    n = sum(p.numel() for p in m.parameters())
    return passed(f"{type(m).__name__} ({getattr(mcfg, 'model_type', '?')}, {n / 1e6:.2f}M parameters) on "
                  f"{next(m.parameters()).device}")


@check("model.not_causal_lm", "error",
       meaning="model.base is not a decoder-only causal LM (an encoder such as BERT, or a sequence-classification "
               "checkpoint).",
       fix="point model.base at the causal-LM checkpoint (…ForCausalLM) the adapter was trained on")
def _not_causal(ctx: Context) -> Outcome:
    ctx.causal
    archs = getattr(ctx.base_config, "architectures", None) or []
    return passed(f"{type(ctx.base_config).__name__}" + (f" ({', '.join(archs)})" if archs else ""))


@check("tokenizer.vocab_mismatch", "error",
       meaning="The tokenizer has more tokens than the model has embedding rows: some token ids index past the "
               "embedding (a tokenizer from another model, or added tokens without resized embeddings).",
       fix="use the tokenizer saved with the model, or resize the embeddings (model.resize_token_embeddings) and "
           "save them")
def _vocab_mismatch(ctx: Context) -> Outcome:
    tok, mcfg = ctx.tokenizer, ctx.base_config
    rows = _vocab_rows(mcfg)
    m = ctx.peek("base_model")
    if m is not None:
        try:
            rows = int(m.get_input_embeddings().num_embeddings)
        except Exception:  # pragma: no cover
            pass
    if rows is None:
        return skipped("the model config has no vocab_size")
    n = len(tok)
    if n > rows:
        return failed(f"the tokenizer of model.base '{ctx.cfg.model.base}' has {n} tokens but the model's embedding has "
                      f"{rows} rows: token ids {rows}..{n - 1} would index past it")
    return passed(f"{n} tokens fit {rows} embedding rows")


@check("model.full_finetune", "error",
       meaning="There is no LoRA adapter to attribute over: model.adapter is unset, or it points at a full model "
               "(config.json, no adapter_config.json).",
       fix="set model.adapter to the PEFT LoRA adapter directory, or run `gradian train CONFIG` to create one")
def _full_finetune(ctx: Context) -> Outcome:
    return passed(f"model.adapter '{ctx.adapter_path}'")


@check("adapter.unreadable", "error",
       meaning="The adapter directory has no readable adapter_config.json (missing, invalid JSON, not an object).",
       fix="point model.adapter at the directory PEFT's save_pretrained wrote")
def _adapter_unreadable(ctx: Context) -> Outcome:
    d = ctx.adapter_config
    p = Path(ctx.adapter_path)
    if p.is_dir() and not any((p / f).exists() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        return failed(f"{p}: adapter_config.json but no adapter_model.safetensors (or .bin) weights")
    return passed(f"{d['__file__']}")


@check("adapter.not_lora", "error",
       meaning="The adapter is a PEFT adapter of another type (prefix tuning, IA3, prompt tuning, ...): gradian "
               "attributes over LoRA parameters only.",
       fix="train a LoRA adapter (peft.LoraConfig), e.g. with `gradian train CONFIG`")
def _not_lora(ctx: Context) -> Outcome:
    d = ctx.adapter_config
    if d.get("peft_type") not in (None, "LORA"):
        return failed(f"{d['__file__']}: peft_type is {d.get('peft_type')!r}, not LORA")
    return passed(f"peft_type {d.get('peft_type') or 'unset (LoRA assumed)'}")


@check("adapter.task_type", "error",
       meaning="The LoRA adapter was trained for another task (e.g. SEQ_CLS): its head and loss are not the causal-LM "
               "next-token loss gradian differentiates.",
       fix="use an adapter trained with task_type CAUSAL_LM")
def _task_type(ctx: Context) -> Outcome:
    d = ctx.adapter_config
    if d.get("task_type") not in (None, "CAUSAL_LM"):
        return failed(f"{d['__file__']}: task_type is {d.get('task_type')!r}, not CAUSAL_LM")
    return passed(f"task_type {d.get('task_type') or 'unset'}")


@check("adapter.quantized", "warning",
       meaning="The adapter was trained on a 4-/8-bit quantized base (QLoRA) or model.base is quantized: gradian's "
               "analysis wants the base in model.dtype, which costs more memory, and its gradients differ slightly "
               "from those of quantized training.",
       fix="point model.base at the full-precision checkpoint the quantized one came from and make sure the device "
           "holds it in model.dtype (see memory.logit_upcast); the LoRA weights apply unchanged")
def _quantized(ctx: Context) -> Outcome:
    found, have_any = [], False
    mcfg = None
    try:
        mcfg = ctx.base_config
        have_any = True
        bits, method = _quant_bits(getattr(mcfg, "quantization_config", None))
        if bits:
            found.append((f"model.base '{ctx.cfg.model.base}' config.json has a quantization_config ({method}, {bits}-bit)",
                          bits))
    except Unavailable:
        pass
    try:
        d = ctx.adapter_config
        have_any = True
        f = d["__file__"]
        for k in ("quantization_config", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type"):
            if d.get(k):
                bits, method = _quant_bits(d[k] if isinstance(d[k], dict) else {k: d[k]})
                found.append((f"{f}: {k} is set ({bits}-bit)", bits or 4))
        loftq = d.get("loftq_config") or {}
        if isinstance(loftq, dict) and loftq.get("loftq_bits"):
            found.append((f"{f}: loftq_config with {loftq['loftq_bits']}-bit base", int(loftq["loftq_bits"])))
        name = str(d.get("base_model_name_or_path") or "")
        if _QUANT_NAME.search(name):
            found.append((f"{f}: trained on '{name}', a quantized checkpoint by its name",
                          8 if "8bit" in name.lower() or "int8" in name.lower() else 4))
    except Unavailable:
        pass
    if not have_any:
        return skipped("neither the base config nor the adapter config loaded")
    if not found:
        return passed("no quantization in the base config or the adapter config")
    bits = min(b for _, b in found)
    params = _param_estimate(mcfg) if mcfg is not None else None  # from the config: packed 4-bit tensors undercount
    if params is None and ctx.peek("base_model") is not None:
        params = sum(p.numel() for p in ctx.peek("base_model").parameters())
    cost = ""
    if params:
        nb = _dtype_bytes(ctx.cfg, mcfg)
        cost = (f"; unquantized in model.dtype {ctx.cfg.model.dtype} the base takes ~{_human(params * nb)} (~{params / 1e9:.2f}B "
                f"parameters x {nb} bytes) instead of ~{_human(params * bits / 8)} at {bits}-bit, and gradients through "
                "it differ slightly from those of quantized training")
    return failed("; ".join(m_ for m_, _ in found) + cost)


@check("adapter.base_mismatch", "error",
       meaning="The adapter was built for another base: its LoRA tensors do not fit model.base (error), or its "
               "recorded base (base_model_name_or_path, gradian_recipe.json) names another model (warning).",
       fix="set model.base to the model the adapter was trained on (adapter_config.json base_model_name_or_path)")
def _base_mismatch(ctx: Context) -> Outcome:
    d = ctx.adapter_config
    try:
        ctx.lora
    except Unavailable:
        return skipped("not a LoRA causal-LM adapter; see adapter.not_lora / adapter.task_type")
    ctx.model  # raises Unavailable(owner=adapter.base_mismatch) when the LoRA tensors do not fit
    notes = []
    recorded = d.get("base_model_name_or_path")
    if recorded and not _same_model_ref(recorded, ctx.base_ref, ctx.cfg.root):
        notes.append(f"{d['__file__']}: base_model_name_or_path is '{recorded}' but model.base is '{ctx.cfg.model.base}'")
    recipe_file = Path(ctx.adapter_path) / "gradian_recipe.json"
    if recipe_file.exists():
        try:
            recipe = json.loads(recipe_file.read_text())
        except (OSError, ValueError):
            recipe = {}
        fp = recipe.get("base_fingerprint") if isinstance(recipe, dict) else None
        base_dir = Path(ctx.base_ref)
        if fp and base_dir.is_dir() and _weights_bytes(base_dir) <= FINGERPRINT_MAX_BYTES:
            from .modeling import dir_fingerprint

            if dir_fingerprint(base_dir) != fp:
                notes.append(f"{recipe_file}: the adapter was trained on a base with fingerprint {fp}, model.base "
                             f"'{ctx.cfg.model.base}' has {dir_fingerprint(base_dir)} (other weights)")
    if notes:
        return failed("; ".join(notes) + "; the LoRA shapes fit, so this may be a copy of the same model",
                      level="warning")
    return passed(f"the adapter's LoRA tensors fit model.base '{ctx.cfg.model.base}'")


@check("adapter.skipped_modules", "warning",
       meaning="LoRA modules gradian cannot capture (LoRA on embeddings or convolutions, DoRA) are left out of the "
               "attribution, as are modules_to_save trained in full; an error when no LoRA Linear site remains "
               "(or grads.module_filter matches none).",
       fix="attribution covers the LoRA Linear layers only; to cover everything, train LoRA on Linear layers "
           "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")
def _skipped_modules(ctx: Context) -> Outcome:
    sites, skipped_ = ctx.sites
    d = ctx.peek("adapter_config") or {}
    mts = d.get("modules_to_save") or []
    parts = []
    if skipped_:
        parts.append(f"{len(skipped_)} LoRA module(s) cannot be captured and are left out: {', '.join(skipped_[:5])}"
                     + (" ..." if len(skipped_) > 5 else ""))
    if mts:
        parts.append(f"modules_to_save {list(mts)} are trained in full and not attributed")
    if parts:
        return failed("; ".join(parts) + f"; {len(sites)} LoRA Linear sites remain")
    kinds = sorted({s.module_type for s in sites})
    return passed(f"{len(sites)} LoRA Linear sites ({', '.join(kinds)})")


@check("train.target_modules", "warning",
       meaning="Some of train.target_modules name no module of model.base: `gradian train` (and verify's retraining) "
               "puts no LoRA there, and fails when none matches.",
       fix="list module names of this architecture in train.target_modules (for Llama-like models: q_proj, k_proj, "
           "v_proj, o_proj, gate_proj, up_proj, down_proj)")
def _train_targets(ctx: Context) -> Outcome:
    targets = list(ctx.cfg.train.target_modules)
    names = [n for n, _ in ctx.base_model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        none = len(missing) == len(targets)
        return failed(f"train.target_modules {missing} match no module of model.base '{ctx.cfg.model.base}'"
                      + (": `gradian train` would fail" if none else ""))
    return passed(f"train.target_modules {targets} all present in model.base")


@check("evaluation.no_eval_set", "warning",
       meaning="data.eval is not set: there is no capability to measure, and attribution is a smoke test.",
       fix="add data.eval: eval records ({prompt, answer}) of the capability that moved")
def _no_eval(ctx: Context) -> Outcome:
    if not ctx.cfg.data.eval:
        return failed("data.eval is not set: `gradian evaluate` has nothing to measure and `gradian attribute` "
                      "would be a smoke test")
    return passed(f"data.eval '{ctx.cfg.data.eval}'")


@check("attribution.no_capability_target", "warning",
       meaning="Without an eval set the attribution has no capability target: its ranking shows the rows with the "
               "largest gradients (outliers), not causes.",
       fix="add data.eval with the items whose answers the fine-tune changed")
def _no_target(ctx: Context) -> Outcome:
    if not ctx.cfg.data.eval:
        return failed("no data.eval: the ranking `gradian attribute` writes would be a smoke test (largest gradients)")
    return passed("data.eval gives the attribution a capability target")


@check("evaluation.small_eval_set", "warning",
       meaning=f"The eval set is too small to detect a moderate capability change: the minimum detectable delta "
               f"(paired test, 80% power, at evaluation.confidence) is above {SMALL_EVAL_MDD}.",
       fix="add eval items: the detectable delta shrinks with 1/sqrt(n) (about 200 items detect a 0.1 change)")
def _small_eval(ctx: Context) -> Outcome:
    from .capability import min_detectable_delta

    items = ctx.eval_items
    if items is None:
        return skipped("no eval set; see evaluation.no_eval_set")
    conf = ctx.cfg.evaluation.confidence
    mdd = min_detectable_delta(len(items), conf)
    msg = (f"{len(items)} eval items ({ctx.eval_path.name}) detect a delta of about {mdd:.2f} or more at "
           f"{int(round(conf * 100))}% confidence and 80% power")
    if mdd > SMALL_EVAL_MDD:
        return failed(msg + "; smaller changes will be declined as not significant")
    return passed(msg)


@check("evaluation.metric_loglik", "info",
       meaning="evaluation.metric is loglik: the reference answer's log-likelihood moves with almost any fine-tune "
               "even when the generated answer does not change, and it gives no generated wrong answer to contrast "
               "with (queries fall back to classic).",
       fix="for factual or format capabilities use evaluation.metric: exact_match (or contains), which measure what "
           "the model actually says")
def _metric_loglik(ctx: Context) -> Outcome:
    m = ctx.cfg.evaluation.metric
    if m == "loglik":
        return failed("evaluation.metric is 'loglik': a shift in likelihood is not a changed answer, and the "
                      "contrastive query falls back to classic")
    return passed(f"evaluation.metric '{m}'")


@check("memory.logit_upcast", "warning",
       meaning="Estimate of the fp32 logits peak of the loss: the chunked loss needs loss_chunk_tokens x vocab x 4 "
               "bytes at a time (versus batch x seq x vocab x 4 for a naive upcast), on top of the weights, compared "
               "with the device's free memory.",
       fix="lower grads.loss_chunk_tokens or grads.batch_size, use model.dtype bfloat16, or a device with more memory")
def _logit_upcast(ctx: Context) -> Outcome:
    mcfg = ctx.base_config
    V = _vocab_rows(mcfg)
    if V is None:
        return skipped("the model config has no vocab_size")
    g = ctx.cfg.grads
    device = ctx.device
    tokens = g.batch_size * g.max_seq_length
    chunk = min(g.loss_chunk_tokens, tokens)
    chunked, naive = chunk * V * 4, tokens * V * 4
    try:  # weights already resident are in the free-memory figure; otherwise add their estimate
        ctx.base_model
        pending = 0
    except Unavailable:
        params = _param_estimate(mcfg)
        pending = params * _dtype_bytes(ctx.cfg, mcfg) if params else 0
    free, where = _free_memory(device)
    msg = (f"fp32 logits peak ~{_human(chunked)} per chunk of {chunk} tokens (grads.loss_chunk_tokens) x vocab {V}; a "
           f"naive upcast of batch {g.batch_size} x seq {g.max_seq_length} would need {_human(naive)}")
    if free is None:
        return passed(msg + f"; free memory on {where} unknown")
    need = chunked + pending
    msg += f"; {_human(free)} {where}" + (f", weights still to load ~{_human(pending)}" if pending else "")
    if need > free:
        return failed(msg + ": the loss would not fit")
    return passed(msg)


@check("index.size", "warning",
       meaning="Estimate of the gradient index on disk: rows x dim x bytes of grads.storage_dtype (+4 bytes per row "
               "for the norm of half-precision rows), dim from the LoRA sites and grads.projection_dim; a warning when "
               "it exceeds the free disk at the index directory.",
       fix="set grads.projection_dim (e.g. 8192) and/or grads.storage_dtype: bfloat16, or point grads.cache_dir at a "
           "bigger disk")
def _index_size(ctx: Context) -> Outcome:
    from .capture import site_shapes
    from .projection import Projector

    sites, _ = ctx.sites
    examples = ctx.examples
    g = ctx.cfg.grads
    try:
        dim = Projector(site_shapes(sites), g.projection_dim, g.projection_kind, g.projection_seed).dim
    except (GradianError, ValueError) as e:  # e.g. a projection_dim below what these sites need
        return failed(str(e), "set grads.projection_dim to a width these LoRA sites allow, or leave it unset (exact)",
                      level="error")
    half = g.storage_dtype in ("float16", "bfloat16")
    per_row = dim * (2 if half else 4) + (4 if half else 0)
    total = len(examples) * per_row
    where = ctx.cfg.index_dir
    anchor = next((q for q in [where, *where.parents] if q.exists()), None)
    free = shutil.disk_usage(anchor).free if anchor is not None and anchor.is_dir() else None
    msg = (f"{len(examples)} rows x dim {dim} ({len(sites)} sites, "
           f"{'projection_dim ' + str(g.projection_dim) if g.projection_dim else 'exact, no projection'}) x "
           f"{g.storage_dtype} = {_human(total)} at {where}")
    if free is None:
        return passed(msg)
    msg += f"; {_human(free)} free there"
    if total > free:
        return failed(msg + ": the index would not fit (rows already cached there are not counted)")
    return passed(msg)


# ================================================================================================= entry points


def run_diagnose(config_path, overrides: Optional[list[str]] = None) -> list[CheckResult]:
    """Load the config (ConfigError propagates: exit 2) and run every check; nothing is written."""
    cfg = load_config(config_path, overrides or [])
    return run_checks(Context(cfg))


def flags_from_checks(results: list[CheckResult]) -> list[dict]:
    """Failed warnings and infos as report.json flags: [{id, level, message, fix}]."""
    return [{"id": r.id, "level": r.level, "message": r.message, "fix": r.fix}
            for r in results if r.status == "fail" and r.level in ("warning", "info")]


def failed_errors(results: list[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status == "fail" and r.level == "error"]


def raise_on_errors(results: list[CheckResult]) -> None:
    errors = failed_errors(results)
    if errors:
        parts = [f"{r.id}: {r.message}" + (f" (fix: {r.fix})" if r.fix else "") for r in errors]
        raise CheckFailed(f"{len(errors)} setup check(s) failed, so nothing was attributed. " + " ".join(
            f"[{i}] {p}" for i, p in enumerate(parts, start=1)) + " Run `gradian diagnose CONFIG` to see every check.")


def run_checks_for_session(session) -> list[CheckResult]:
    """The checks over what `api.open_session` loaded (nothing is reloaded but small config files).

    Failed warnings/infos go into `session.flags` (report.json `flags`); any failed error-level check raises
    CheckFailed (exit code 2) listing them, before anything is written.
    """
    results = run_checks(Context.from_session(session))
    for f in flags_from_checks(results):
        session.flag(f["id"], f["level"], f["message"], f["fix"])
    raise_on_errors(results)
    return results


def print_checks(results: list[CheckResult], console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    t = Table(title="gradian diagnose", show_lines=False, expand=False)
    t.add_column("", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("level", no_wrap=True)
    t.add_column("message / fix", overflow="fold")
    colour = {"error": "red", "warning": "yellow", "info": "cyan"}
    for r in results:
        if r.status == "pass":
            mark, level, msg = "[green]ok[/]", f"[dim]{r.level}[/]", escape(r.message)
        elif r.status == "skip":
            mark, level, msg = "[dim]skip[/]", f"[dim]{r.level}[/]", f"[dim]{escape(r.message)}[/]"
        else:
            mark, level = f"[bold {colour[r.level]}]FAIL[/]", f"[{colour[r.level]}]{r.level}[/]"
            msg = escape(r.message) + (f"\n[bold]fix:[/] {escape(r.fix)}" if r.fix else "")
        t.add_row(mark, r.id, level, msg)
    console.print(t)
    n = {lvl: sum(1 for r in results if r.status == "fail" and r.level == lvl) for lvl in LEVELS}
    skips = sum(1 for r in results if r.status == "skip")
    console.print(f"{len(results)} checks: {n['error']} error(s), {n['warning']} warning(s), {n['info']} info, "
                  f"{skips} skipped" + (" — fix the errors before `gradian attribute`" if n["error"] else ""))


def checks_markdown() -> str:
    """The check-id reference (docs/checks.md) generated from the registry."""
    lines = ["| id | level | meaning | fix |", "|---|---|---|---|"]
    for c in REGISTRY.values():
        lines.append(f"| `{c.id}` | {c.level} | {c.meaning} | {c.fix} |")
    return "\n".join(lines)
