"""Typed run configuration: YAML in, validated models out, errors that name the key path."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError


# ------------------------------------------------------------------------------------ the strings a config names
# Each is a `StrEnum`: YAML gives the same strings, `model_dump` writes them back, a member equals (and hashes as)
# its string and formats as it, so messages and reports read the same. Code chooses a strategy from a member once
# (a registry keyed by it), never by comparing strings.


class PreconditionerKind(StrEnum):
    """`attribution.preconditioner` (one class each in `attribution.precondition`)."""

    identity = "identity"
    diagonal = "diagonal"
    fisher = "fisher"
    datainf = "datainf"
    ekfac = "ekfac"


class QueryFormulation(StrEnum):
    """`attribution.query`: what a failing item's query loss contrasts (`attribution.queries`). The setting only:
    `attribution.formulation.asked` maps it onto a `Formulation` (the one vocabulary, one class each), which every
    other module asks."""

    auto = "auto"  # behaviour for a metric that defines a class of answers (regex, python), else contrastive
    contrastive = "contrastive"
    classic = "classic"
    behaviour = "behaviour"


class MetricKind(StrEnum):
    """The kind of `evaluation.metric` (one class each in `capability.metrics`); ``python`` is any
    ``python:module:function``."""

    exact_match = "exact_match"
    contains = "contains"
    loglik = "loglik"
    regex = "regex"
    python = "python"


PYTHON_METRIC_PREFIX = "python:"


def metric_kind(name: str) -> MetricKind:
    """The kind of a metric name: ``python`` for python:module:function, else the builtin it names (ValueError
    when it names none)."""
    if str(name).startswith(PYTHON_METRIC_PREFIX):
        return MetricKind.python
    kind = MetricKind(name)
    if kind is MetricKind.python:  # the kind alone names no function
        raise ValueError(f"{name!r} is not a metric name; a Python metric is written python:module:function")
    return kind


class ProjectionKind(StrEnum):
    """`grads.projection_kind` (`projection.Projector`)."""

    rademacher = "rademacher"
    gaussian = "gaussian"
    sjlt = "sjlt"
    data_aware = "data-aware"


class _Section(BaseModel):
    # Unknown keys are an error: a typo such as `grads.projection_dims` must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    base: str
    adapter: Optional[str] = None
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    # Load the base through bitsandbytes (QLoRA): nf4 (4-bit NormalFloat) or int8 (LLM.int8); needs gradian[quant].
    quantization: Literal["none", "nf4", "int8"] = "none"
    threads: Optional[int] = Field(default=None, ge=1)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in {"auto", "cpu", "cuda", "mps"} or v.startswith("cuda:"):
            return v
        raise ValueError("expected one of auto, cpu, cuda, cuda:N, mps")


class DataConfig(_Section):
    train: str
    eval: Optional[str] = None


class GradsConfig(_Section):
    module_filter: Optional[list[str]] = None
    storage_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # auto: exact gradients when the exact index is small (`projection.auto`), else a data-aware projection with
    # exact re-ranking; an int: that width; null: exact gradients whatever their size.
    projection_dim: Union[Literal["auto"], Annotated[int, Field(ge=1)], None] = "auto"
    projection_kind: ProjectionKind = ProjectionKind.data_aware
    projection_seed: int = 0
    # Rows a data-aware basis is fitted on (2 exact capture passes over them before the build): more rows cost more
    # but fit a basis closer to the whole set's gradient subspace.
    projection_fit_rows: int = Field(default=512, ge=1)
    rerank: int = Field(default=200, ge=0)
    fidelity_sample: int = Field(default=512, ge=0)
    fidelity_warn: float = Field(default=0.9, ge=0.0, le=1.0)
    batch_size: int = Field(default=8, ge=1)
    max_seq_length: int = Field(default=512, ge=8)
    loss_chunk_tokens: int = Field(default=1024, ge=1)
    cache_dir: Optional[str] = None
    shard_rows: int = Field(default=256, ge=1)


BUILTIN_METRICS = tuple(k.value for k in MetricKind if k is not MetricKind.python)


class EvaluationConfig(_Section):
    # exact_match | contains | loglik | regex (the item's answer, or evaluation.pattern, searched in the answer) |
    # python:module:function (score(prompt, generated, item) -> [0, 1], imported from the config's directory or the
    # environment)
    metric: str = "exact_match"
    pattern: Optional[str] = None  # regex: one pattern for every item (the item's answer otherwise)
    negate: bool = False  # regex: an item passes when the pattern does NOT match
    require_significant: bool = True
    confidence: float = Field(default=0.95, gt=0.0, lt=1.0)
    bootstrap_samples: int = Field(default=10_000, ge=100)
    max_new_tokens: int = Field(default=32, ge=1)
    batch_size: int = Field(default=16, ge=1)

    @property
    def metric_kind(self) -> MetricKind:
        """What kind of metric `metric` names (``python`` for python:module:function)."""
        return metric_kind(self.metric)

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v in BUILTIN_METRICS:
            return v
        if v.startswith(PYTHON_METRIC_PREFIX):
            parts = v.split(":")
            if len(parts) != 3 or not all(p.strip() for p in parts[1:]):
                raise ValueError(f"'{v}': a Python metric is written python:module:function, e.g. "
                                 "python:my_metrics:score (my_metrics.py beside the config file)")
            return v
        raise ValueError(f"'{v}' is not a metric; use one of {', '.join(BUILTIN_METRICS)} or python:module:function")

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            import re

            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression ({e}): {v!r}; fix the pattern (Python `re` "
                                 "syntax; in YAML quote it with single quotes)") from None
        return v

    @model_validator(mode="after")
    def _regex_settings(self):
        if self.metric_kind is not MetricKind.regex and (self.pattern is not None or self.negate):
            key = "evaluation.pattern" if self.pattern is not None else "evaluation.negate"
            raise ValueError(f"{key} is set but evaluation.metric is '{self.metric}'; they apply to metric: regex "
                             "only (drop the key, or set evaluation.metric: regex)")
        return self

class AttributionConfig(_Section):
    query: QueryFormulation = QueryFormulation.auto
    preconditioner: PreconditionerKind = PreconditionerKind.diagonal
    damping: Optional[float] = Field(default=None, gt=0.0)
    top_k: int = Field(default=50, ge=1)
    max_items: int = Field(default=256, ge=1)
    # Scale every training row to unit norm in the preconditioner's metric (a cosine): raw inner products let
    # high-loss, long or chatty rows dominate and memorised rows vanish at the final adapter.
    unit_rows: bool = True
    # Conversations of several exchanges ranked by their best exchange, each at unit norm (with unit_rows; such a
    # set takes the one pass): one planted reply is not diluted by the benign turns around it. The report's
    # per-item scores stay the whole row's.
    per_turn: bool = True
    # How the failing items' scores combine into a row's ranking score. auto (the default): max for own-words queries
    # (the item a row stands out on most, in robust z units of each item's own rows: each failing item is its own
    # fact or turn, taught by its own few rows, and averaging over the items dilutes such a row by their number), mean
    # for every other query (a behaviour's items share one cause, and the mean averages out each item's noise). The
    # accused rows have their own statistic either way (`accused`).
    combine: Literal["auto", "mean", "max"] = "auto"
    # The per-row store the one pass leaves under grads.cache_dir (keyed by the model, the adapter state, the data
    # and the scoring settings): a killed pass resumes from it, a rerun reads its scores back, and a later question
    # (another eval set or metric) is, with shortlist (the default), scored exactly on each item's reference rows
    # and the rows the store's sketches shortlist (on the 2,000-row SmolLM2 set the same top 50 as a full pass, in
    # the same order, at about a fifth of its cost: bench/real_models.py smol_mixed --second-question); with full,
    # by a pass over every row again; off keeps no store.
    store: Literal["shortlist", "full", "off"] = "shortlist"
    # attribution.query: behaviour: answers sampled per failing item from the fine-tune, and their temperature.
    # 16 at 0.7: the query is a Monte Carlo mean over the behaviour's wordings; 8 answers, or temperature 1's
    # garbled ones, left one planted row of 8-10 at the ranking's edge on some draws (bench/README.md).
    behaviour_samples: int = Field(default=16, ge=1)
    behaviour_temperature: float = Field(default=0.7, gt=0.0, le=2.0)
    # Which adapters the scores come from. earliest (the default): the earliest saved checkpoint alone (before the
    # fine-tune memorised its rows; the final adapter when none was saved), one pass over the rows; auto: averaged
    # over the checkpoints saved with the adapter (gradian train's checkpoints/epoch-*, a Trainer's checkpoint-*)
    # and the final adapter (TracIn-CP), one pass per checkpoint; N: N checkpoints averaged, replayed from the
    # adapter's Gradian recipe when fewer were saved. Evidence for the default: bench/README.md.
    checkpoints: Union[Literal["auto", "earliest"], Annotated[int, Field(ge=1)]] = "earliest"
    checkpoint_adapters: list[str] = Field(default_factory=list)
    # adamw: scores that model the recorded AdamW run (momentum and second-moment coupling) in place of the
    # preconditioned ones, for adapters `gradian train` recorded (attribution.optimizer).
    optimizer: Literal["none", "adamw"] = "none"


class TrainConfig(_Section):
    learning_rate: float = Field(default=2e-3, gt=0.0)
    epochs: int = Field(default=3, ge=1)
    batch_size: int = Field(default=8, ge=1)
    lora_r: int = Field(default=8, ge=1)
    lora_alpha: float = Field(default=16.0, gt=0.0)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    weight_decay: float = Field(default=0.0, ge=0.0)
    max_grad_norm: Optional[float] = Field(default=1.0, gt=0.0)
    max_seq_length: int = Field(default=512, ge=8)
    # Keep every earlier epoch's adapter in OUT/checkpoints/epoch-k (what attribution.checkpoints: auto averages).
    save_checkpoints: bool = True
    output: Optional[str] = None
    # Learning-rate schedule (transformers' get_scheduler names) with linear warm-up over warmup_steps steps.
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    # supervised: assistant turns / completions / text (what attribution differentiates); all: every token.
    loss: Literal["supervised", "all"] = "supervised"
    # Who trains: gradian's own loop (hf), TRL's SFTTrainer (trl), unsloth (GPU), or any script (train.command).
    backend: Literal["hf", "trl", "unsloth", "command"] = "hf"
    command: Optional[str] = None
    command_timeout: Optional[float] = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _command_backend(self):
        if self.command is not None and not self.command.strip():
            raise ValueError("train.command is empty; give the training command line or remove the key")
        if self.command and "backend" in self.model_fields_set and self.backend != "command":
            raise ValueError(f"train.command is set but train.backend is '{self.backend}'; drop one of them "
                             "(train.command alone selects the command backend)")
        if self.backend == "command" and not self.command:
            raise ValueError("train.backend is 'command' but train.command is not set; give the training command "
                             "line, e.g. 'python train.py --data {train} --out {output} --seed {seed}'")
        return self

    @property
    def backend_name(self) -> str:
        return "command" if self.command else self.backend


class Config(_Section):
    model: ModelConfig
    data: DataConfig
    grads: GradsConfig = Field(default_factory=GradsConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    attribution: AttributionConfig = Field(default_factory=AttributionConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    output: str = "gradian-out"
    seed: int = 0

    # Directory of the config file: relative paths in the config resolve against it, not the shell's cwd.
    root: Optional[str] = Field(default=None, exclude=True)

    def path(self, value: Optional[str]) -> Optional[Path]:
        """Resolve a path-valued setting relative to the config file."""
        if value is None:
            return None
        p = Path(value).expanduser()
        if not p.is_absolute() and self.root is not None:
            p = Path(self.root) / p
        return p

    def local_or_hub(self, value: Optional[str], key: str = "model") -> Optional[str]:
        """A model reference: a local path when one exists relative to the config, else a hub id ("org/name").

        A missing path that cannot be a hub id is an error here, rather than a slow failing hub request later.
        """
        if value is None:
            return None
        p = self.path(value)
        if p is not None and p.exists():
            return str(p)
        first = Path(value).parts[0] if Path(value).parts else value
        looks_local = (value.startswith((".", "/", "~")) or "\\" in value or value.count("/") > 1
                       or (self.root is not None and (Path(self.root) / first).exists()))
        if looks_local or (key == "model.adapter" and "/" not in value):
            raise ConfigError(f"{key}: '{value}' does not exist (resolved to {p}); relative paths resolve against the "
                              "config file" + ("; run `gradian train CONFIG` to create the adapter" if key == "model.adapter" else ""),
                              check="config.paths")
        return value

    @property
    def output_dir(self) -> Path:
        return self.path(self.output)  # type: ignore[return-value]

    @property
    def adapter_out(self) -> Path:
        """Where `gradian train` writes: train.output, else model.adapter (what attribute reads), else OUT/adapter."""
        for v in (self.train.output, self.model.adapter):
            if v:
                return self.path(v)  # type: ignore[return-value]
        return self.output_dir / "adapter"

    @property
    def index_dir(self) -> Path:
        return self.path(self.grads.cache_dir) if self.grads.cache_dir else self.output_dir / "index"  # type: ignore[return-value]


def _set_in(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: '{k}' is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value`; the value is read as YAML so numbers, booleans, null and lists keep their types."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. --set grads.batch_size=4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: empty key path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _format_validation(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key '{loc}' (check the spelling; docs/config.md lists every key)")
        elif e["type"] == "missing":
            lines.append(f"{source}: missing required key '{loc}'")
        else:
            lines.append(f"{source}: key '{loc}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def config_from_dict(data: dict, *, root: Optional[Path] = None, source: str = "config") -> Config:
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation(err, source)) from None
    cfg.root = str(root) if root is not None else None
    return cfg


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> Config:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    if path.is_dir():
        candidate = path / "gradian.yaml"
        if not candidate.exists():
            raise ConfigError(f"{path}: is a directory without a gradian.yaml; pass the config file itself")
        path = candidate
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (model, data, ...), got {type(data).__name__}")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_in(data, key, value)
    cfg = config_from_dict(data, root=path.resolve().parent, source=str(path))
    _check_output_dirs(cfg, str(path))
    return cfg


def _check_output_dirs(cfg: Config, source: str) -> None:
    """An output location blocked by an existing file is a config error now, not an OSError after the work is done."""
    adapter_key = "train.output" if cfg.train.output else ("model.adapter" if cfg.model.adapter else "output")
    for key, p in (("output", cfg.output_dir), ("grads.cache_dir" if cfg.grads.cache_dir else "output", cfg.index_dir),
                   (adapter_key, cfg.adapter_out)):
        for q in (p, *p.parents):
            if q.exists():
                if not q.is_dir():
                    what = "a file, not a directory" if q == p else f"a file, so the directory {p} cannot be created"
                    raise ConfigError(f"{source}: key '{key}': {q} is {what}; choose another path or move the file")
                break


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude={"root"}), sort_keys=False)
