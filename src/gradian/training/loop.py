"""Deterministic LoRA SFT (assistant-only, token-weighted loss) that records the recipe it used.

The loop is written out rather than delegated to `transformers.Trainer` because attribution and `verify` depend on
properties Trainer does not promise: a data order fixed by the seed alone, bit-identical replays on CPU, and removal
of examples by zero-weighting them in place, so every other example keeps its batch and its step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import torch

from ..config import Config
from ..errors import ConfigError, ModelError
from ..grads.objectives import per_example_loss
from ..io import atomic_dir, dir_fingerprint
from ..progress import progress_bar
from ..runtime import seed_everything
from ..setup.batches import collate
from ..setup.model import load_base, load_tokenizer
from ..setup.records import data_location, dataset_fingerprint, load_train
from ..setup.tokenize import tokenize_example
from .optimizer_state import save_optimizer_state
from .recipe import RECIPE_FILE, Recipe
from .schedule import make_scheduler

# Earlier epochs' adapters inside a `gradian train` output (attribution.checkpoints: auto reads them).
CHECKPOINTS_SUBDIR = "checkpoints"


def data_order(n: int, epochs: int, batch_size: int, seed: int) -> list[list[list[int]]]:
    """Batches of positions per epoch, a function of (n, epochs, batch_size, seed) only."""
    out = []
    for e in range(epochs):
        perm = np.random.default_rng([seed, e]).permutation(n).tolist()
        out.append([perm[s : s + batch_size] for s in range(0, n, batch_size)])
    return out


@dataclass(frozen=True)
class TrainData:
    """What a run trains on: the recipe's hyperparameters and seed (a retrain's, or the config's for a fresh run),
    the epoch it stops after (a checkpoint replay), the tokenizer, the rows, their fingerprint and tokens, and the
    positions removed (zero-weighted in place)."""

    hp: dict
    seed: int
    stop_epoch: Optional[int]
    tokenizer: Any
    examples: list
    fingerprint: str
    toks: list
    excluded: frozenset[int]


@dataclass(frozen=True)
class StepPlan:
    """The optimizer steps: each epoch's batches (`data_order`) grouped by gradient accumulation, how many steps
    the schedule spans and how many this run takes, and the learning-rate schedule."""

    groups: list
    total_steps: int
    n_steps: int
    sched_name: str
    warmup: int

    @property
    def scheduled(self) -> bool:
        """Whether a scheduler steps at all: a constant rate steps none (the runs recorded before schedules existed
        stay bit-identical)."""
        return not (self.sched_name == "constant" and self.warmup == 0)


@dataclass(frozen=True)
class CheckpointPlan:
    """Where the adapter goes, the epochs after which it is also saved and where, and the staging folder whose
    epochs move inside the output (`save_checkpoints`)."""

    out_dir: Path
    save_at: list[int]
    checkpoint_dir: Optional[Path]
    staging: Optional[Path]


@dataclass(frozen=True)
class TrainLog:
    """What the loop records as it goes (into every recipe it writes): the rate of each step, the loss curve and the
    checkpoints saved so far."""

    rates: list = field(default_factory=list)
    curve: list = field(default_factory=list)
    saved: list = field(default_factory=list)


def train_data(cfg: Config, recipe: Optional[Recipe], exclude: Iterable[int]) -> TrainData:
    """Step 1: the recipe's settings, seeded, and the tokenized rows; ModelError when the recipe was recorded on
    other data."""
    hp = recipe.hp if recipe else train_hyperparameters(cfg)
    seed = int(recipe.seed) if recipe else cfg.seed
    stop_epoch = recipe.stop_epoch if recipe else None
    seed_everything(seed)
    tok = load_tokenizer(cfg)
    examples = load_train(data_location(cfg, cfg.data.train))
    fp = dataset_fingerprint(examples)
    if recipe and recipe.dataset_fingerprint not in (None, fp):
        raise ModelError(
            f"{cfg.data.train}: the training set differs from the one the recipe was recorded on "
            f"(fingerprint {fp} vs {recipe.dataset_fingerprint}); verify needs the original data"
        )
    toks = [tokenize_example(tok, e, hp["max_seq_length"], loss=hp.get("loss", "supervised")) for e in examples]
    return TrainData(hp, seed, stop_epoch, tok, examples, fp, toks, frozenset(int(p) for p in exclude))


def lora_model(cfg: Config, data: TrainData):
    """Step 2: the base with a fresh LoRA adapter (its A initialised from the seed), in train mode, its trainable
    parameters and their AdamW."""
    from peft import LoraConfig, get_peft_model

    hp = data.hp
    base = load_base(cfg)
    torch.manual_seed(data.seed)  # LoRA A init
    lcfg = LoraConfig(
        r=hp["lora_r"], lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"],
        target_modules=hp["target_modules"], task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(base, lcfg)
    except ValueError as e:
        raise ConfigError(f"train.target_modules {hp['target_modules']}: {e}") from None
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=hp["learning_rate"], weight_decay=hp["weight_decay"])
    return model, params, opt


def step_plan(data: TrainData) -> StepPlan:
    """Step 3: the data order and the optimizer steps it makes."""
    hp = data.hp
    order = data_order(len(data.examples), hp["epochs"], hp["batch_size"], data.seed)
    accum = int(hp.get("gradient_accumulation_steps") or 1)
    groups = [[ep[i : i + accum] for i in range(0, len(ep), accum)] for ep in order]  # optimizer steps per epoch
    stop = data.stop_epoch
    n_steps = sum(len(ep) for ep in order[:stop] if ep) if stop else sum(len(ep) for ep in order)
    return StepPlan(groups, sum(len(g) for g in groups), n_steps, hp.get("lr_scheduler") or "constant",
                    int(hp.get("warmup_steps") or 0))


def checkpoint_plan(cfg: Config, data: TrainData, recipe: Optional[Recipe], out_dir: Optional[Path],
                    checkpoint_epochs: Iterable[int], checkpoint_dir: Optional[Path],
                    save_checkpoints: Optional[bool]) -> CheckpointPlan:
    """Step 4: the epochs saved on the way (asked for, or every earlier one with `save_checkpoints`)."""
    hp = data.hp
    save_at = sorted(set(int(k) for k in checkpoint_epochs))
    if save_at and (checkpoint_dir is None or save_at[0] < 1 or save_at[-1] > (data.stop_epoch or hp["epochs"])):
        raise ValueError(f"checkpoint_epochs {save_at}: need a checkpoint_dir and epochs within 1..{hp['epochs']}")
    if save_checkpoints is None:
        save_checkpoints = recipe is None and cfg.train.save_checkpoints
    out_dir = Path(out_dir) if out_dir else cfg.adapter_out
    staging: Optional[Path] = None
    if save_checkpoints and not save_at and hp["epochs"] > 1:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.checkpoints-", dir=out_dir.parent))
        checkpoint_dir, save_at = staging, list(range(1, hp["epochs"]))
    return CheckpointPlan(out_dir, save_at, checkpoint_dir, staging)


def loop_recipe(cfg: Config, data: TrainData, plan: StepPlan, log: TrainLog, epochs: int, *, base_fp: str,
                started: float) -> Recipe:
    """The recipe of the adapter after `epochs` epochs: how to train it again, bit for bit."""
    hp, stop_epoch = data.hp, data.stop_epoch
    scheduled = plan.scheduled and plan.sched_name != "constant"
    stop = epochs if scheduled and epochs < hp["epochs"] else stop_epoch
    return Recipe.model_validate({
        "schema": "gradian.recipe/1",
        "backend": "hf",
        "seed": data.seed,
        "hyperparameters": {**hp, "epochs": hp["epochs"] if scheduled else epochs},
        "schedule": (f"{plan.sched_name} learning rate" + (f" after {plan.warmup} warm-up steps" if plan.warmup else "")
                     + ", AdamW, token-weighted mean over each step's supervised tokens"),
        "total_steps": plan.total_steps,
        "step": len(log.rates),
        "learning_rates": list(log.rates),
        "loss_curve": [list(c) for c in log.curve],
        "checkpoints": [dict(c) for c in log.saved],
        **({"stop_epoch": stop} if stop else {}),
        "data": str(data_location(cfg, cfg.data.train)),
        "dataset_fingerprint": data.fingerprint,
        "n_examples": len(data.examples),
        "excluded_positions": sorted(data.excluded),
        "removal": "zero-weighted in place: other examples keep their batches and steps",
        "data_order": "numpy default_rng([seed, epoch]).permutation(n), batches of batch_size",
        "base": cfg.model.base,
        "base_fingerprint": base_fp,
        "train_seconds": round(time.time() - started, 2),
    })


def _packed(group: list, data: TrainData, pad: int, gen: torch.Generator) -> tuple[list, float]:
    """A step's batches collated with their row weights (0 for a removed row) and dropout seeds, and the number of
    supervised tokens the step's loss is the mean over."""
    packed = []
    for batch in group:
        ids, attn, sup = collate([data.toks[i] for i in batch], pad)
        weights = torch.tensor([0.0 if i in data.excluded else 1.0 for i in batch])
        # Dropout masks drawn from our own generator keep replays identical when dropout is on. The
        # seed is drawn before a fully excluded batch is skipped, so later steps keep their masks.
        step_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        packed.append((ids, attn, sup, weights, step_seed))
    # The loss of a step is the token-weighted mean over every supervised token of its batches (with
    # gradient accumulation too, as transformers' Trainer does with num_items_in_batch).
    n_tok = sum(float((sup[:, 1:].sum(1).float() * w).sum()) for _, _, sup, w, _ in packed)
    return packed, n_tok


def _backward(model, packed: list, n_tok: float, device) -> float:
    """The step's gradients accumulated over its batches; returns its loss."""
    total = 0.0
    for ids, attn, sup, weights, step_seed in packed:
        if float((sup[:, 1:].sum(1).float() * weights).sum()) == 0 and len(packed) > 1:
            continue
        torch.manual_seed(step_seed)
        losses = per_example_loss(model, ids.to(device), attn.to(device), sup.to(device))
        loss = (losses * weights.to(device)).sum() / n_tok
        loss.backward()
        total += float(loss.detach())
    return total


def train_epochs(model, params, opt, sched, data: TrainData, plan: StepPlan, ck: CheckpointPlan, log: TrainLog,
                 record, *, progress: bool, recorder=None) -> None:
    """Step 5: the epochs, step by step, saving the adapter (with `record(epoch)`) after each epoch in
    `ck.save_at` before the last."""
    hp = data.hp
    pad = data.tokenizer.pad_token_id
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(data.seed)
    last_epoch = data.stop_epoch or hp["epochs"]
    with progress_bar("train", total=plan.n_steps if progress else 0, unit="steps") as bar:
        for e_no, epoch in enumerate(plan.groups, start=1):
            if e_no > last_epoch:
                break
            for group in epoch:
                packed, n_tok = _packed(group, data, pad, gen)
                log.rates.append(float(opt.param_groups[0]["lr"]))
                if n_tok == 0:  # every row of the step excluded: no update, the schedule still moves on
                    bar.advance(len(group))
                    if sched is not None:
                        sched.step()
                    continue
                opt.zero_grad(set_to_none=True)
                total = _backward(model, packed, n_tok, device)
                grad_norm = None
                if hp.get("max_grad_norm"):
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, hp["max_grad_norm"])
                opt.step()
                if recorder is not None:  # before the scheduler moves: the rate this step used
                    recorder.step(opt, epoch=e_no, positions=[i for b in group for i in b if i not in data.excluded],
                                  n_tok=n_tok, grad_norm=grad_norm, max_grad_norm=hp.get("max_grad_norm"))
                if sched is not None:
                    sched.step()
                log.curve.append([len(log.rates), total])
                bar.advance(len(group))
            if e_no in ck.save_at and e_no < last_epoch:
                log.saved.append({"name": f"epoch-{e_no}", "epoch": e_no, "step": len(log.rates),
                                  "learning_rate": log.rates[-1] if log.rates else None})
                model.eval()
                save_adapter(model, Path(ck.checkpoint_dir) / f"epoch-{e_no}", record(e_no), optimizer=opt)
                model.train()


def train_adapter(
    cfg: Config, *, exclude: Iterable[int] = (), out_dir: Optional[Path] = None, recipe: Optional[Recipe] = None,
    progress: bool = True, checkpoint_epochs: Iterable[int] = (), checkpoint_dir: Optional[Path] = None,
    save_checkpoints: Optional[bool] = None, recorder=None,
) -> Path:
    """Train a LoRA adapter on data.train (minus `exclude` positions, zero-weighted in place); returns its dir.

    `checkpoint_epochs` (1-based) also saves the adapter after each of those epochs to `checkpoint_dir/epoch-<k>`,
    each with its own recipe (``epochs: k``). The data order and the constant schedule depend on the epoch index
    only, so a checkpoint is bit-identical to a run trained for k epochs.

    `save_checkpoints` (default: `train.save_checkpoints` for a fresh run, off for a retrain from a `recipe`) keeps
    the adapter of every earlier epoch inside the output, in `OUT/checkpoints/epoch-<k>`, where
    `attribution.checkpoints: auto` finds them (a few LoRA-sized files; no replay needed later).

    `recorder` (an `attribution.optimizer.TrajectoryRecorder`) sees the optimizer after every step and writes what
    it kept into the adapter directory at the end."""
    t0 = time.time()
    data = train_data(cfg, recipe, exclude)
    model, params, opt = lora_model(cfg, data)
    if recorder is not None:
        recorder.start(model, params, opt)
    plan = step_plan(data)
    sched = make_scheduler(opt, plan.sched_name, warmup_steps=plan.warmup,
                           total_steps=plan.total_steps) if plan.scheduled else None
    ck = checkpoint_plan(cfg, data, recipe, out_dir, checkpoint_epochs, checkpoint_dir, save_checkpoints)
    base_fp = dir_fingerprint(cfg.local_or_hub(cfg.model.base))
    log = TrainLog()

    def record(epochs: int) -> Recipe:
        return loop_recipe(cfg, data, plan, log, epochs, base_fp=base_fp, started=t0)

    train_epochs(model, params, opt, sched, data, plan, ck, log, record, progress=progress, recorder=recorder)
    last_epoch = data.stop_epoch or data.hp["epochs"]
    model.eval()
    try:
        save_adapter(model, ck.out_dir, record(last_epoch if data.stop_epoch else data.hp["epochs"]),
                     checkpoints=ck.staging, optimizer=opt)
    finally:
        if ck.staging is not None:
            shutil.rmtree(ck.staging, ignore_errors=True)
    if recorder is not None:
        recorder.save(ck.out_dir, n_rows=len(data.examples), dataset_fingerprint=data.fingerprint)
    if ck.save_at and ck.save_at[-1] == last_epoch and ck.staging is None:
        save_adapter(model, Path(ck.checkpoint_dir) / f"epoch-{last_epoch}", record(last_epoch), optimizer=opt)
    return ck.out_dir


def train_hyperparameters(cfg: Config) -> dict:
    """The `train.*` recipe keys of the config (not where to write it or which backend runs it)."""
    return cfg.train.model_dump(exclude={"output", "backend", "command", "command_timeout"})


def save_adapter(model, out_dir: Path, recipe: Recipe, *, checkpoints: Optional[Path] = None,
                 optimizer=None) -> Path:
    """The adapter and its recipe, written beside `out_dir` and renamed into place (never half written); the
    folder `checkpoints`, when given, is moved inside it as `CHECKPOINTS_SUBDIR`; the `optimizer`'s state, when
    given, as `optimizer.pt` (as a Trainer's checkpoint holds it: a preconditioner can read Adam's second moments
    from it, `optimizer_state.second_moments`)."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        (tmp / RECIPE_FILE).write_text(recipe.to_json())
        if optimizer is not None:
            save_optimizer_state(optimizer, model, tmp)
        if checkpoints is not None and Path(checkpoints).is_dir():
            os.replace(checkpoints, tmp / CHECKPOINTS_SUBDIR)
    return Path(out_dir)
