"""Flags in place of a config file: `gradian attribute --adapter DIR --train FILE --eval FILE --metric M --out DIR`.

A TRL or HF Trainer run already holds what a config names: the output directory has the adapter
(`adapter_config.json`, whose `base_model_name_or_path` is the base) and its `checkpoint-*` folders, the data are
files. The flags build the same `Config` a YAML file would (`--set` for every other key, as with a file); given with a
CONFIG they override the file. A run from flags writes the settings it used to `OUT/gradian.yaml` (paths absolute,
`output: .`), so the next verb is `gradian verify OUT/gradian.yaml`.

A flag that cannot be used is a `ConfigError` (exit code 2) naming the flag and what to do, raised before anything
runs or is written. Flag paths resolve against the shell's working directory, as a user typing them expects; the
keys of a config file keep resolving against the file's directory.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config import BUILTIN_METRICS, Config, MetricKind, metric_kind, _check_output_dirs, _set_in, config_from_dict, load_config, parse_override
from ..errors import ConfigError

# First line of an OUT/gradian.yaml written from flags: a later run from flags may replace such a file, never one a
# person wrote.
MARK = "# gradian: the settings of a run given by command-line flags"
CONFIG_NAME = "gradian.yaml"

# Suffixes of data files; a value with one of them is a file, never a hub dataset id.
DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".csv", ".txt")
PROMPT_LIST = ".txt"  # one prompt per line: an eval set whose metric says once what passes (records.read_records)


@dataclass(frozen=True)
class RunFlags:
    """The flags a verb takes in place of (or on top of) CONFIG; None (False for `negate`) = not given."""

    adapter: Optional[str] = None
    base: Optional[str] = None
    train: Optional[str] = None
    eval: Optional[str] = None
    metric: Optional[str] = None
    pattern: Optional[str] = None
    negate: bool = False
    out: Optional[str] = None

    def given(self) -> bool:
        return any(getattr(self, f.name) not in (None, False) for f in fields(self))


@dataclass(frozen=True)
class Run:
    """The config a verb runs with, and whether it came from flags (then it is written to OUT/gradian.yaml)."""

    cfg: Config
    from_flags: bool

    @property
    def settings_path(self) -> Path:
        return self.cfg.output_dir / CONFIG_NAME


USAGE = ("give a config file (gradian VERB gradian.yaml) or the flags of a run: --adapter DIR (the output_dir of "
         "your TRL/HF run, or the adapter directory) --train FILE (the data it trained on) --eval FILE (prompts whose "
         "answers changed) --metric NAME --out DIR")
RUN_FLAGS = "the flags of a run: --adapter DIR --train FILE --eval FILE --metric NAME --out DIR, or a config file"


def resolve_run(config: Optional[Path], flags: RunFlags, sets: Optional[list[str]] = None, *,
                cwd: Optional[Path] = None, writes: bool = True) -> Run:
    """The Config of a verb from CONFIG and/or flags and the `--set` overrides (ConfigError naming the flag or key).

    `writes`: the verb writes into OUT, and so will write OUT/gradian.yaml when the settings came from flags; a
    gradian.yaml there that a person wrote is refused now rather than replaced later."""
    sets = list(sets or [])
    if config is None and not flags.given():
        raise ConfigError("no CONFIG and no flags: " + USAGE)
    if not flags.given():
        return Run(load_config(config, sets), from_flags=False)
    cwd = Path(cwd or Path.cwd()).absolute()
    file_data = _file_data(config)
    keys = _flag_keys(flags, cwd, file_data)
    for s in sets:
        k, _ = parse_override(s)
        if k in keys:
            raise ConfigError(f"--set {s!r} and {keys[k][0]} both set {k}; give it once")
    if config is not None:
        as_sets = [f"{k}={json.dumps(v)}" for k, (_, v) in keys.items()]  # JSON is YAML: strings stay strings
        cfg = load_config(config, as_sets + sets)
        if settings_dict(cfg) == settings_dict(load_config(config, sets)):  # the flags repeat the file
            return Run(cfg, from_flags=False)
    else:
        data: dict = {}
        for k, (_, v) in keys.items():
            _set_in(data, k, v)
        for s in sets:
            _set_in(data, *parse_override(s))
        cfg = config_from_dict(data, root=cwd, source="the command line")
        _check_output_dirs(cfg, "the command line")
    _check_prompt_list(cfg, keys)
    run = Run(cfg, from_flags=True)
    if writes:
        _check_settings_target(run, config)
    return run


def write_settings(run: Run, verb: str) -> Optional[Path]:
    """OUT/gradian.yaml: every setting of a run from flags, paths absolute, `output: .` (None for a file run)."""
    if not run.from_flags:
        return None
    from ..io import atomic_write_text

    path = run.settings_path
    head = (f"{MARK} (`gradian {verb}`).\n# Rerun any verb with the same settings: gradian verify {path}\n"
            "# (relative paths resolve against this file's directory)\n")
    atomic_write_text(path, head + yaml.safe_dump(settings_dict(run.cfg), sort_keys=False, allow_unicode=True))
    return path


def settings_dict(cfg: Config) -> dict:
    """The config as a mapping that means the same from OUT/gradian.yaml: local paths absolute, `output: .`."""
    from .records import HubDataset, data_location

    d = cfg.model_dump(mode="json", exclude={"root"})
    m = d["model"]
    m["base"] = cfg.local_or_hub(cfg.model.base, "model.base")
    if cfg.model.adapter:
        m["adapter"] = str(cfg.path(cfg.model.adapter))
    for key in ("train", "eval"):
        loc = data_location(cfg, getattr(cfg.data, key))
        if loc is not None:
            d["data"][key] = loc.text if isinstance(loc, HubDataset) else str(loc)
    if cfg.grads.cache_dir:
        d["grads"]["cache_dir"] = str(cfg.path(cfg.grads.cache_dir))
    if cfg.train.output:
        d["train"]["output"] = str(cfg.path(cfg.train.output))
    if "backend" not in cfg.train.model_fields_set:
        # unset, the backend is the adapter's recipe's (`training.backends.backend_for`: a TRL run retrains through
        # TRL); written, the default `hf` would pin every later verb's retrains to gradian's own loop
        d["train"].pop("backend", None)
    d["attribution"]["checkpoint_adapters"] = [str(cfg.path(p)) for p in cfg.attribution.checkpoint_adapters]
    d["output"] = "."
    return d


# ------------------------------------------------------------------------------------------ flags -> keys


def _file_data(config: Optional[Path]) -> dict:
    """The config file's mapping, to see which keys it sets (load_config reports a file it cannot read)."""
    if config is None:
        return {}
    p = Path(config)
    p = p / CONFIG_NAME if p.is_dir() else p
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _flag_keys(flags: RunFlags, cwd: Path, file_data: dict) -> dict[str, tuple[str, Any]]:
    """{config key: (the flag that sets it, value)}, every flag checked here."""
    keys: dict[str, tuple[str, Any]] = {}
    if flags.adapter is not None:
        adapter, base_named = _adapter(flags.adapter, cwd)
        keys["model.adapter"] = ("--adapter", str(adapter))
        # The base the adapter names, unless --base is given or the config file names one (explicit beats inferred;
        # adapter.base_mismatch says when the two differ).
        file_base = (file_data.get("model") or {}).get("base") if isinstance(file_data.get("model"), dict) else None
        if flags.base is None and not file_base:
            keys["model.base"] = ("--adapter", _model(base_named, "--adapter", cwd, adapter=adapter))
    if flags.base is not None:
        keys["model.base"] = ("--base", _model(flags.base, "--base", cwd))
    if flags.train is not None:
        if Path(flags.train).suffix.lower() == PROMPT_LIST:
            raise ConfigError(f"--train {flags.train}: a .txt file is read as a list of prompts, which is an eval set "
                              "(--eval); give the records the fine-tune trained on (.jsonl, .json, .parquet, .csv, a "
                              "save_to_disk folder or a hub dataset id org/name)")
        keys["data.train"] = ("--train", _data(flags.train, "--train", cwd))
    if flags.eval is not None:
        keys["data.eval"] = ("--eval", _data(flags.eval, "--eval", cwd))
    keys.update(_metric_keys(flags))
    if flags.out is not None:
        out = _abs(flags.out, cwd)
        blocked = next((q for q in (out, *out.parents) if q.exists()), None)
        if blocked is not None and not blocked.is_dir():
            raise ConfigError(f"--out {flags.out}: {blocked} is a file, not a directory; give the directory the run "
                              "writes into (created when missing)")
        keys["output"] = ("--out", str(out))
    if flags.adapter is None and "model" not in file_data:
        raise ConfigError("missing --adapter: point it at the output_dir of your TRL/HF run (where "
                          "trainer.save_model wrote adapter_config.json) or at the adapter directory (" + RUN_FLAGS + ")")
    if flags.train is None and "data" not in file_data:
        raise ConfigError("missing --train: give the training data the fine-tune read (.jsonl, .json, .parquet, "
                          ".csv or a hub dataset id org/name) (" + RUN_FLAGS + ")")
    return keys


def _metric_keys(flags: RunFlags) -> dict[str, tuple[str, Any]]:
    keys: dict[str, tuple[str, Any]] = {}
    metric = flags.metric
    if metric is not None:
        shape_ok = metric in BUILTIN_METRICS or (metric.startswith("python:") and len(metric.split(":")) == 3
                                                and all(p.strip() for p in metric.split(":")[1:]))
        if not shape_ok:
            raise ConfigError(f"--metric {metric!r} is not a metric; use exact_match (the answer as written), contains "
                              "(the answer anywhere in what the model says), regex (--pattern once for every prompt, "
                              "or each item's answer as a pattern), loglik (the answer's likelihood), or "
                              "python:module:function (a function of yours, module.py in the working directory)")
    regex_flags = [f for f, given in (("--pattern", flags.pattern is not None), ("--negate", flags.negate)) if given]
    if regex_flags and metric is not None and metric_kind(metric) is not MetricKind.regex:
        raise ConfigError(f"{' and '.join(regex_flags)} with --metric {metric}: they say what a regex metric looks "
                          "for; use --metric regex (or drop them)")
    if flags.pattern is not None:
        try:
            re.compile(flags.pattern)
        except re.error as e:
            raise ConfigError(f"--pattern {flags.pattern!r}: not a valid regular expression ({e}); fix it (Python "
                              "`re` syntax; quote it for the shell, e.g. --pattern '(?i)\\bcanberra\\b')") from None
    if metric is not None or regex_flags:
        keys["evaluation.metric"] = ("--metric" if metric is not None else regex_flags[0], metric or "regex")
        # the flags say the whole metric: a pattern or negation in the file belongs to the metric they replace
        keys["evaluation.pattern"] = ("--pattern" if flags.pattern is not None else "--metric", flags.pattern)
        keys["evaluation.negate"] = ("--negate" if flags.negate else "--metric", bool(flags.negate))
    return keys


def _abs(value: str, cwd: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else cwd / p


def _looks_local(value: str) -> bool:
    return value.startswith((".", "/", "~")) or "\\" in value or value.count("/") > 1


def _model(value: str, flag: str, cwd: Path, *, adapter: Optional[Path] = None) -> str:
    """A base model: an existing local directory (absolute), else a hub id ("org/name" or "name")."""
    cands = [_abs(value, cwd)] + ([adapter / value] if adapter is not None and not Path(value).is_absolute() else [])
    for p in cands:
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{flag}: the base '{value}' is a file ({p}); give the model's directory (config.json "
                                  "and weights) or its hub id")
            return str(p)
    if not _looks_local(value):
        return value  # a hub id: fetched (or found in the hub cache) when the model loads
    if adapter is not None:
        raise ConfigError(f"--adapter {adapter}: its adapter_config.json names the base '{value}' "
                          f"(base_model_name_or_path), which is not here ({cands[0]}); pass --base with the directory "
                          "(or hub id) of the model the adapter was trained on")
    raise ConfigError(f"{flag} {value}: no such model directory ({cands[0]}); give the directory of the model the "
                      "adapter was trained on (config.json and weights) or its hub id (org/name)")


def _adapter(value: str, cwd: Path) -> tuple[Path, Any]:
    """(the adapter directory, the base its adapter_config.json names)."""
    p = _abs(value, cwd)
    if p.is_file() and p.name == "adapter_config.json":
        p = p.parent
    if not p.exists():
        raise ConfigError(f"--adapter {value}: no such directory ({p}); give the output_dir of your TRL/HF run (where "
                          "trainer.save_model wrote adapter_config.json) or the adapter directory")
    if not p.is_dir():
        raise ConfigError(f"--adapter {value}: {p} is a file; give the directory that holds adapter_config.json")
    cfg_file = p / "adapter_config.json"
    if not cfg_file.exists():
        ckpts = sorted((c for c in p.glob("checkpoint-*") if (c / "adapter_config.json").exists()),
                       key=lambda c: int(c.name.split("-")[-1]) if c.name.split("-")[-1].isdigit() else -1)
        if ckpts:
            hint = (f"; it holds {len(ckpts)} checkpoint folder(s) with an adapter: save the final adapter there "
                    f"(trainer.save_model(output_dir) after trainer.train()), or attribute the last checkpoint: "
                    f"--adapter {ckpts[-1]}")
        elif (p / "config.json").exists():
            hint = ("; it holds a full model (config.json), not a LoRA adapter: gradian attributes LoRA fine-tunes "
                    "(peft.LoraConfig, e.g. SFTTrainer(peft_config=...))")
        else:
            inside = sorted(c for c in p.iterdir() if (c / "adapter_config.json").exists())
            hint = (f"; {inside[0]} holds one: --adapter {inside[0]}" if inside else
                    "; give the directory PEFT's save_pretrained (or trainer.save_model) wrote")
        raise ConfigError(f"--adapter {value}: no adapter_config.json in {p}, so it is not a PEFT adapter" + hint)
    try:
        ac = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--adapter {value}: {cfg_file} cannot be read as JSON ({e}); give the directory PEFT's "
                          "save_pretrained wrote") from None
    base = ac.get("base_model_name_or_path") if isinstance(ac, dict) else None
    if not isinstance(base, str) or not base.strip():
        base = None
    return p, base


def _data(value: str, flag: str, cwd: Path) -> str:
    """A data file or folder (absolute), else a hub dataset id `org/name[:split][@revision]`."""
    from .records import HUB_ID

    p = _abs(value, cwd)
    if p.exists():
        return str(p)
    m = HUB_ID.match(value)
    if m and not value.startswith((".", "/", "~")) and Path(m.group("repo")).suffix.lower() not in DATA_SUFFIXES \
            and not (cwd / Path(value).parts[0]).exists():
        return value
    raise ConfigError(f"{flag} {value}: no such file ({p}); give a .jsonl, .json, .parquet or .csv file"
                      + (", a .txt list of prompts (one per line)" if flag == "--eval" else "")
                      + ", a save_to_disk folder, or a hub dataset id (org/name)")


def _check_prompt_list(cfg: Config, keys: dict) -> None:
    """A prompt list has no answers: the metric must say once what passes (regex with a pattern, a Python metric)."""
    if not cfg.data.eval or Path(cfg.data.eval).suffix.lower() != PROMPT_LIST:
        return
    e = cfg.evaluation
    if e.metric_kind is MetricKind.python or (e.metric_kind is MetricKind.regex and e.pattern is not None):
        return
    where = "--eval" if "data.eval" in keys else "data.eval"
    raise ConfigError(
        f"{where} {cfg.data.eval} is a list of prompts without answers, but the metric '{e.metric}' compares each "
        "answer with a reference. Say once what passes for every prompt: --metric regex --pattern 'Canberra' (what "
        "the answer must contain), with --negate for what it must not (--pattern \"I can't\" --negate), or a Python "
        "metric; or give a JSONL of {\"prompt\": ..., \"answer\": ...} records")


def _check_settings_target(run: Run, config: Optional[Path]) -> None:
    """OUT/gradian.yaml may be replaced only when a run from flags wrote it."""
    p = run.settings_path
    if not p.exists():
        return
    if p.is_dir():
        raise ConfigError(f"--out: {p} is a directory; the run writes its settings there as a file, so move it or "
                          "choose another --out")
    try:
        first = p.read_text(encoding="utf-8").split("\n", 1)[0]
    except (OSError, UnicodeDecodeError):
        first = ""
    if first.startswith(MARK):
        return
    own = config is not None and p.resolve() == (Path(config) / CONFIG_NAME if Path(config).is_dir()
                                                 else Path(config)).resolve()
    raise ConfigError(
        f"--out: {p} is {'the config file this run read' if own else 'a config file gradian did not write'}, and a "
        "run from flags writes the settings it used there (so that `gradian verify OUT/gradian.yaml` repeats them). "
        "Give --out a new directory, or put the settings in the file and run it without flags")


# ----------------------------------------------------------------------------------- eval set size


def items_to_detect(delta: float, confidence: float = 0.95, power: float = 0.8, sd: float = 0.5) -> int:
    """The fewest eval items whose minimum detectable delta (capability.metrics.min_detectable_delta, the estimate
    behind evaluation.small_eval_set) is at most `delta`."""
    from statistics import NormalDist

    from ..capability.metrics import min_detectable_delta

    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2) + NormalDist().inv_cdf(power)
    n = max(1, math.ceil((z * sd / delta) ** 2))
    while n > 1 and min_detectable_delta(n - 1, confidence, power, sd) <= delta:
        n -= 1
    while min_detectable_delta(n, confidence, power, sd) > delta:
        n += 1
    return n


def eval_size_note(n: int, confidence: float, delta: float) -> str:
    """What `diagnose` says about the eval set's size before anything costly runs."""
    from ..capability.metrics import min_detectable_delta

    need = items_to_detect(delta, confidence)
    conf = f"{int(round(confidence * 100))}% confidence, 80% power"
    have = f"{n} eval item{'s' if n != 1 else ''} detect a capability change of {min_detectable_delta(n, confidence):.2f} or more ({conf})"
    if n >= need:
        return f"eval set: {have}; a change of {delta:g} needs {need}, which it has."
    return (f"eval set: {have}; to detect a change of {delta:g} it needs {need} items ({need - n} more; --delta sets "
            "the change you care about). Smaller changes are declined as not significant.")
