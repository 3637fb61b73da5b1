"""Retraining for `verify` and `fidelity`: the recipe's training run without some rows, and its capability.

Removal is in place for gradian's loop (zero-weighted, `training.loop.train_adapter`) and TRL (labels -100,
`training.trl`): the data order does not depend on what is removed, so every remaining row keeps its batch and its
step. A `train.command` gets the kept rows as a file and orders them itself.

`retrain_many` is the one loop over retrains (verify's reference, accused and controls; fidelity's reference, LOO
and LDS subsets; bench/counterfactual.py): under torchrun retrain j is rank j % N's (`distributed.run_owned`), run
by that rank alone, and every rank gets every result in job order, so N processes give one process's answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Optional, Sequence, TypeVar

from .. import distributed as dist_
from ..config import Config
from ..errors import VerifyError
from ..training.recipe import Recipe

M = TypeVar("M")


def adapters_equal(a: Path, b: Path) -> bool:
    """Every tensor of two saved adapters equal (torch.equal), same names and shapes."""
    import torch
    from safetensors.torch import load_file

    fa, fb = Path(a) / "adapter_model.safetensors", Path(b) / "adapter_model.safetensors"
    if not (fa.exists() and fb.exists()):
        return False
    ta, tb = load_file(str(fa)), load_file(str(fb))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def retrain_recipe(cfg: Config) -> tuple[Optional[Recipe], str]:
    """(the recipe retrains start from, where it is). A `train.command` is its own recipe (None); every other
    backend retrains from the recipe beside model.adapter (`load_recipe`: gradian train's, the TRL backend's or the
    one GradianCallback recorded), or, in a TRL / HF Trainer output dir without one, the recipe its files hold
    (`trainer_dir.recipe_for_retrain`)."""
    from ..training.trainer_dir import recipe_for_retrain

    if cfg.train.command:
        return None, f"train.command: {cfg.train.command}"
    recipe, path = recipe_for_retrain(cfg)
    return recipe, str(path)


def removal_text(cfg: Config, recipe: Optional[Recipe]) -> str:
    from ..training.backends import IN_PLACE, backend_for

    b = backend_for(cfg, recipe)
    if IN_PLACE[b]:
        how = "labels set to -100 in the collator" if b in ("trl", "unsloth") else "zero-weighted in the loss"
        return f"{b} backend: removed rows {how}, in place: other rows keep their batches and steps"
    return ("train.command: removed rows left out of the {train} file; the script orders and batches the rest itself, "
            "so the random controls are retrained the same way and compared like for like")


def retrain(cfg: Config, recipe: Optional[Recipe], exclude: Sequence[int], out_dir: Path, user_adapter: Path, *,
            progress: bool = True, log_path: Optional[Path] = None, label: str = "retrain") -> Path:
    """The recipe's adapter trained again without the rows at `exclude`, written to `out_dir` (never into or
    around the user's adapter), through the backend `training.backends.backend_for` picks."""
    from ..training.backends import init_file_of, run_training

    out_dir = Path(out_dir)
    ua = Path(user_adapter).resolve()
    od = out_dir.resolve()
    if od == ua or ua in od.parents or od in ua.parents:
        raise VerifyError(f"{out_dir}: refusing to retrain into or around the user's adapter {user_adapter}")
    return run_training(cfg, recipe=recipe, exclude=list(exclude), out_dir=out_dir, progress=progress,
                        init_file=init_file_of(recipe, user_adapter), log_path=log_path, label=label)


def measure_adapter(cfg: Config, adapter: Path, s) -> tuple[list[float], list[str]]:
    """Per-item scores and answers of a retrained adapter on the session's eval items, generated exactly as the
    fine-tune's were (`capability.evaluate.item_scores`). The model is loaded for this and freed after it."""
    from ..capability.evaluate import item_scores
    from ..setup.model import load_model

    e = cfg.evaluation
    model = load_model(cfg, str(adapter))
    try:
        return item_scores(model, s.tokenizer, s.eval_items, metric=s.metric, chat=s.chat,
                           max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, max_len=cfg.grads.max_seq_length,
                           desc="retrained answers", one_line=s.one_line)
    finally:
        del model


# ------------------------------------------------------------------------------------------------ many retrains


@dataclass(frozen=True)
class RetrainJob:
    """One retrain: its name (the label in logs and results), the rows it removes, and where its adapter goes."""

    name: str
    exclude: tuple[int, ...]
    out_dir: Path


@dataclass(frozen=True)
class RetrainSettings:
    """What every retrain of a run shares: the config, the recipe it replays and the user's adapter (never written
    into), whether each retrain shows its own training bar, and the log a `train.command` appends to."""

    cfg: Config
    recipe: Optional[Recipe]
    user_adapter: Path
    progress: bool = True
    log_path: Optional[Path] = None


@dataclass(frozen=True)
class Retrained(Generic[M]):
    """A finished retrain: its job, the adapter it wrote, what `measure` returned for it, and its seconds (wall
    clock and this process's CPU) of training and of measuring."""

    job: RetrainJob
    path: Path
    measured: M
    train_seconds: float
    measure_seconds: float
    train_cpu_seconds: float
    measure_cpu_seconds: float


def retrain_many(settings: RetrainSettings, jobs: Sequence[RetrainJob], measure: Callable[[RetrainJob, Path], M], *,
                 before: Optional[Callable[[int, RetrainJob], None]] = None,
                 after: Optional[Callable[[int, Retrained[M]], None]] = None) -> list[Retrained[M]]:
    """Every job retrained (`retrain`) and measured (`measure(job, adapter dir)`, right after its retrain, on the
    rank that trained it), in job order. `before(j, job)` and `after(j, retrained)` run on the owning rank around
    each job (progress lines, bars). Under torchrun job j is rank j % N's, one retrain per rank at a time, and the results
    are gathered on every rank (`distributed.run_owned`): what `measure` returns must pickle."""

    def one(j: int) -> Retrained[M]:
        job = jobs[j]
        if before is not None:
            before(j, job)
        with dist_.alone():
            w0, c0 = time.time(), time.process_time()
            path = retrain(settings.cfg, settings.recipe, job.exclude, job.out_dir, settings.user_adapter,
                           progress=settings.progress, log_path=settings.log_path, label=job.name)
            w1, c1 = time.time(), time.process_time()
            measured = measure(job, path)
            w2, c2 = time.time(), time.process_time()
        done = Retrained(job, path, measured, w1 - w0, w2 - w1, c1 - c0, c2 - c1)
        if after is not None:
            after(j, done)
        return done

    every = dist_.run_owned(len(jobs), one)
    return [every[j] for j in range(len(jobs))]
