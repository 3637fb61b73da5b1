"""The public Python API: what every `gradian` verb does, callable from a notebook or a script.

    from gradian import api

    cfg = api.load_config("runs/demo/gradian.yaml", ["output=out-notebook"])   # or api.config_from_dict({...})
    checks = api.diagnose(cfg)                  # [CheckResult(id, level, status, message, fix)]
    report = api.attribute(cfg)                 # a typed Report (report.json); also writes report.html
    print(report.verdict, report.capability.delta, [r.position for r in report.ranking[:10]])
    result = api.verify(cfg, top_k=10)          # the verify.json document

Each function takes a validated `Config` (or a path to a config file) and writes where the CLI verb writes; errors
are `gradian.errors.GradianError`s whose message names the file, key or module and says what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from .config import Config, config_from_dict, load_config
from .distributed import barrier, current

__all__ = ["Config", "attribute", "build_index", "config_from_dict", "diagnose", "evaluate", "fidelity",
           "load_config", "train", "verify"]

ConfigLike = Union[Config, str, Path]


def _cfg(cfg: ConfigLike) -> Config:
    return cfg if isinstance(cfg, Config) else load_config(cfg)


def diagnose(cfg: ConfigLike) -> list:
    """Every setup check (`gradian diagnose`): a list of `CheckResult`s; nothing is written."""
    from .checks import Context, run_checks

    return run_checks(Context(_cfg(cfg)))


def train(cfg: ConfigLike) -> Path:
    """LoRA SFT with the config's `train.*` recipe (`gradian train`) through `train.backend` (or `train.command`);
    returns the adapter directory."""
    from .attribution.optimizer import TrajectoryRecorder
    from .training.backends import run_training

    # the optimizer's trajectory, for attribution.optimizer: adamw (a few adapter-sized tensors per epoch)
    return run_training(_cfg(cfg), recorder=TrajectoryRecorder())


def evaluate(cfg: ConfigLike):
    """The capability delta, base vs fine-tune, with its paired bootstrap interval (`gradian evaluate`); writes
    OUT/capability.json and returns the `CapabilityResult`."""
    import json

    from .io import atomic_write_text
    from .pipeline import evaluate as _evaluate
    from .report.build import capability_json
    from .setup.session import open_session

    c = _cfg(cfg)
    s = open_session(c)
    cap = _evaluate(s)
    if current().is_main:  # under torchrun every rank has the gathered result; one writes it
        atomic_write_text(c.output_dir / "capability.json", json.dumps(capability_json(cap, s.eval_items), indent=2))
    return cap


def build_index(cfg: ConfigLike):
    """Build or reuse the gradient index (`gradian index`); returns its `IndexInfo`."""
    from .pipeline import index_stage
    from .setup.session import open_session

    s = open_session(_cfg(cfg), need_eval=False)
    ix = index_stage(s)
    ix.close()
    return ix.info


def attribute(cfg: ConfigLike, *, truth: Optional[dict] = None):
    """The main job (`gradian attribute`): evaluate, index, query, score, explain. Writes OUT/report.json,
    scores.npy and report.html; returns the report as a typed `gradian.report.schema.Report`."""
    from .pipeline import attribute as _attribute
    from .report.schema import Report

    c = _cfg(cfg)
    _attribute(c, truth=truth)
    barrier()  # under torchrun rank 0 wrote the report; every rank returns it
    return Report.model_validate_json((c.output_dir / "report.json").read_text(encoding="utf-8"))


def verify(cfg: ConfigLike, *, top_k: Optional[int] = None, controls: int = 3, keep_adapters: bool = False,
           reference: bool = True) -> dict:
    """Retrain without the top-k accused rows and without k random rows, and re-measure (`gradian verify`);
    returns the verify.json document."""
    from .validate.verify import run_verify

    return run_verify(_cfg(cfg), top_k=top_k, controls=controls, keep_adapters=keep_adapters, reference=reference)


def fidelity(cfg: ConfigLike, *, loo: int = 20, subsets: int = 50, frac: float = 0.05,
             preconditioners: Optional[Sequence[str]] = None) -> dict:
    """Leave-one-out and LDS on deterministic retrains (`gradian fidelity`); returns the fidelity.json document."""
    from .validate.fidelity import run_fidelity

    return run_fidelity(_cfg(cfg), loo=loo, subsets=subsets, frac=frac,
                        preconditioners=list(preconditioners) if preconditioners else None)
