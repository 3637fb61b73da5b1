"""`train.backend: trl`: LoRA SFT through TRL's `SFTTrainer`, deterministic on CPU, with rows removed in place.

What a retrain keeps from the run it reproduces:

* the data order: the Trainer's own `RandomSampler`, drawn from the global generator that `set_seed(args.seed)`
  resets, over a dataset of the same length (a removed row stays in it), so every batch holds the same rows;
* removal: the collator sets every label of a removed row to -100, so it adds nothing to its batch's loss and its
  tokens leave `num_items_in_batch` (the loss stays the token-weighted mean over the other rows); a step whose rows
  are all removed makes no update (AdamW would otherwise move on its momentum), the schedule still steps;
* the LoRA initialisation: TRL seeds with `args.seed` before wrapping the model (`peft_config`), or, for a run the
  `GradianCallback` recorded, the adapter weights it saved before the first step;
* the recipe of a recorded run (`trainer_args`: the training arguments that matter) and a check that TRL's
  tokenized training set is the one the callback fingerprinted.

TRL is an optional extra (`pip install 'gradian[trl]'`), imported only here and only when this backend runs.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import ConfigError, ModelError
from .recipe import Recipe
# the dataset side lives in trl_dataset; these names stay importable from here (integrations.callback, tests)
from .trl_dataset import POSITION, ExcludingCollator, tokenized_fingerprint, trl_rows  # noqa: F401
from .trainer_args import TRAINER_ARG_KEYS, recorded_args  # noqa: F401  (importable from here as before)

TRL_EXTRA = "pip install 'gradian[trl]'  (TRL >= 1.16)"
INIT_ADAPTER_FILE = "gradian_init_adapter.safetensors"

def import_trl():
    try:
        import trl  # noqa: F401
        from trl import SFTConfig, SFTTrainer
    except ImportError as e:
        raise ConfigError(f"train.backend: trl needs TRL, which is not installed ({e}); {TRL_EXTRA}") from None
    return SFTConfig, SFTTrainer


# ------------------------------------------------------------------------------------------------ SFTConfig


def sft_arguments(hp: dict, seed: int, recorded: Optional[dict], loss_flags: dict, *, out: Path, device,
                  dtype: str, progress: bool) -> dict[str, Any]:
    """SFTConfig keyword arguments: the recorded run's (callback) or the recipe's, and the settings a retrain
    needs whatever the run used (no reporting, no hub, no checkpoints of the Trainer's own, every column kept)."""
    if recorded:
        kw = dict(recorded)
        if (not kw.get("max_steps") or kw["max_steps"] <= 0) and \
                math.ceil(float(kw.get("num_train_epochs") or 0)) != hp["epochs"]:
            kw["num_train_epochs"] = hp["epochs"]  # a constant-rate checkpoint replay is a shorter run
    else:
        kw = {
            "learning_rate": hp["learning_rate"], "num_train_epochs": hp["epochs"],
            "per_device_train_batch_size": hp["batch_size"],
            "gradient_accumulation_steps": int(hp.get("gradient_accumulation_steps") or 1),
            "lr_scheduler_type": ("constant_with_warmup" if hp.get("lr_scheduler", "constant") == "constant"
                                  and hp.get("warmup_steps") else hp.get("lr_scheduler", "constant")),
            "warmup_steps": int(hp.get("warmup_steps") or 0), "weight_decay": hp.get("weight_decay", 0.0),
            "max_grad_norm": hp.get("max_grad_norm") or 0.0, "max_length": hp["max_seq_length"], "seed": seed,
            "full_determinism": True, "optim": "adamw_torch", "gradient_checkpointing": False,
            "bf16": dtype == "bfloat16", "fp16": dtype == "float16", "logging_steps": 1, **loss_flags,
        }
    kw.update({
        "output_dir": str(out), "report_to": [], "save_strategy": "no", "push_to_hub": False,
        "disable_tqdm": True, "remove_unused_columns": False, "dataloader_num_workers": 0,
        "use_cpu": getattr(device, "type", str(device)) == "cpu", "eval_strategy": "no",
    })
    if kw.get("use_cpu"):
        if not recorded:  # a recorded run's bf16 autocast (TRL's default) is part of its recipe: replayed as it ran
            kw["bf16"] = kw.get("bf16") and dtype == "bfloat16"
        kw["fp16"] = False  # no fp16 autocast on CPU
    return kw


def lora_config_of(hp: dict, recorded: Optional[dict]):
    from peft import LoraConfig

    if recorded:
        fields = set(LoraConfig.__dataclass_fields__)
        kw = {k: v for k, v in recorded.items() if k in fields and k not in ("base_model_name_or_path", "revision",
                                                                              "peft_type", "auto_mapping")}
        kw["task_type"] = "CAUSAL_LM"
        kw["inference_mode"] = False  # an adapter_config.json is saved for inference; a retrain trains it
        return LoraConfig(**kw)
    return LoraConfig(r=hp["lora_r"], lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"],
                      target_modules=hp["target_modules"], task_type="CAUSAL_LM")


# ------------------------------------------------------------------------------------------------ the run


@dataclass(frozen=True)
class TrlData:
    """What a TRL run trains on: the recipe's hyperparameters and seed, the epoch it stops after, the model a
    `model_factory` made (or None), the tokenizer, the rows as TRL reads them with their loss settings, the rows'
    fingerprint and count, the recorded training arguments (a callback run) and the removed positions."""

    hp: dict
    seed: int
    stop_epoch: Optional[int]
    made: Optional[tuple]
    tokenizer: Any
    rows: list
    loss_flags: dict
    fingerprint: str
    n_examples: int
    recorded: Optional[dict]
    excluded: list[int]


@dataclass(frozen=True)
class TrlPlan:
    """The SFTConfig arguments (and those this TRL does not know), the epochs, the checkpoint epochs and where they
    go, and the scratch folder of the run."""

    kw: dict
    unknown: list[str]
    total_epochs: int
    last_epoch: int
    save_at: list[int]
    checkpoint_dir: Optional[Path]
    staging: Optional[Path]
    work: Path
    out_dir: Path

    @property
    def scheduled(self) -> bool:
        return self.kw.get("lr_scheduler_type") not in ("constant", "constant_with_warmup")


@dataclass(frozen=True)
class TrlLog:
    """What the callback records as training goes: rates, loss curve, saved checkpoints, and the run's total steps
    and tokenized fingerprint (`state`)."""

    rates: list = field(default_factory=list)
    curve: list = field(default_factory=list)
    saved: list = field(default_factory=list)
    state: dict = field(default_factory=dict)


def trl_data(cfg, recipe: Optional[Recipe], exclude: Iterable[int], model_factory) -> TrlData:
    """Step 1: the recipe's settings, seeded, the model a factory makes, and the rows; ModelError when the recipe
    was recorded on other data."""
    from ..runtime import seed_everything
    from ..setup.model import load_tokenizer
    from ..setup.records import data_location, dataset_fingerprint, load_train
    from .loop import train_hyperparameters

    hp = recipe.hp if recipe else train_hyperparameters(cfg)
    seed = int(recipe.seed) if recipe else cfg.seed
    seed_everything(seed)
    made = model_factory(cfg, hp, seed) if model_factory is not None else None
    tok = made[1] if made else load_tokenizer(cfg)
    examples = load_train(data_location(cfg, cfg.data.train))
    fp = dataset_fingerprint(examples)
    if recipe and recipe.dataset_fingerprint not in (None, fp):
        raise ModelError(f"{cfg.data.train}: the training set differs from the one the recipe was recorded on "
                         f"(fingerprint {fp} vs {recipe.dataset_fingerprint}); verify needs the original data")
    rows, loss_flags = trl_rows(examples, tok, hp.get("loss", "supervised"))
    return TrlData(hp, seed, recipe.stop_epoch if recipe else None, made, tok, rows, loss_flags, fp, len(examples),
                   recipe.trainer_args if recipe else None, sorted(set(int(p) for p in exclude)))


def trl_plan(cfg, data: TrlData, base, recipe: Optional[Recipe], out_dir: Optional[Path], *, progress: bool,
             checkpoint_epochs: Iterable[int], checkpoint_dir: Optional[Path],
             save_checkpoints: Optional[bool]) -> TrlPlan:
    """Step 2: the SFTConfig arguments for this TRL and the checkpoints to save, in a fresh scratch folder beside
    the output."""
    SFTConfig, _ = import_trl()
    from .loop import CHECKPOINTS_SUBDIR

    out_dir = Path(out_dir) if out_dir else cfg.adapter_out
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.trl-", dir=out_dir.parent))
    device = next(base.parameters()).device
    kw = sft_arguments(data.hp, data.seed, data.recorded, data.loss_flags, out=work / "trainer", device=device,
                       dtype=cfg.model.dtype, progress=progress)
    fields_ = set(SFTConfig.__dataclass_fields__)
    unknown = sorted(k for k in kw if k not in fields_)
    kw = {k: v for k, v in kw.items() if k in fields_}
    total_epochs = int(kw.get("num_train_epochs") or data.hp["epochs"])
    save_at = sorted(set(int(k) for k in checkpoint_epochs))
    if save_checkpoints is None:
        save_checkpoints = recipe is None and cfg.train.save_checkpoints
    staging: Optional[Path] = None
    if save_checkpoints and not save_at and total_epochs > 1:
        staging = work / CHECKPOINTS_SUBDIR
        checkpoint_dir, save_at = staging, list(range(1, total_epochs))
    return TrlPlan(kw, unknown, total_epochs, data.stop_epoch or total_epochs, save_at, checkpoint_dir, staging, work,
                   out_dir)


def trl_recipe(cfg, data: TrlData, plan: TrlPlan, log: TrlLog, recipe: Optional[Recipe], epoch: int, step: int,
               tfp: Optional[str], *, backend_name: str, base_fp: str, started: float) -> Recipe:
    """The recipe of the adapter after `epoch` epochs (`step` steps): how to train it again through TRL."""
    from ..setup.records import data_location

    kw = plan.kw
    stop = epoch if (plan.scheduled and epoch < plan.total_epochs) else data.stop_epoch
    base_rec = recipe.model_dump(mode="json", by_alias=True, exclude_unset=True) if recipe else {}
    for k in ("stop_epoch", "excluded_positions", "learning_rates", "loss_curve", "checkpoints", "step",
              "train_seconds", "removal"):
        base_rec.pop(k, None)
    return Recipe.model_validate({
        **base_rec,
        "schema": "gradian.recipe/1", "backend": backend_name, "seed": data.seed,
        "hyperparameters": {**data.hp, "epochs": plan.total_epochs if plan.scheduled else epoch},
        "schedule": f"TRL SFTTrainer, {kw.get('lr_scheduler_type')} learning rate, {kw.get('optim')}",
        "trainer_args": ({k: v for k, v in kw.items() if k in TRAINER_ARG_KEYS} if not data.recorded
                         else data.recorded),
        "data": str(data_location(cfg, cfg.data.train)), "dataset_fingerprint": data.fingerprint,
        "n_examples": data.n_examples, "excluded_positions": data.excluded,
        "removal": "labels of removed rows set to -100 in place: other rows keep their batches and steps",
        "data_order": "the Trainer's RandomSampler after set_seed(seed), over every row",
        "base": cfg.model.base, "base_fingerprint": base_fp,
        "tokenized_fingerprint": tfp, "step": step, "total_steps": log.state.get("max_steps"),
        "learning_rates": list(log.rates[:step]), "loss_curve": [c for c in log.curve if c[0] <= step],
        "checkpoints": [dict(c) for c in log.saved if c["step"] <= step],
        **({"stop_epoch": stop} if stop else {}),
        "train_seconds": round(time.time() - started, 2),
    })


def _record_callback(plan: TrlPlan, log: TrlLog, stop_epoch: Optional[int], record,
                     expected_steps: Optional[tuple] = None):
    """The TrainerCallback that records rates, losses and steps, advances gradian's bar (`log.state["bar"]`),
    saves the checkpoint epochs and stops a checkpoint replay after its epoch; it stops before the first step when
    the run takes other than `expected_steps` steps (a recipe read from a Trainer dir)."""
    from transformers import TrainerCallback

    from .loop import save_adapter

    class _Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            log.state["max_steps"] = state.max_steps
            if expected_steps and state.max_steps != expected_steps[0]:
                raise ModelError(expected_steps[1](state.max_steps))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            log.rates.append(float(kwargs["lr_scheduler"].get_last_lr()[0]))

        def on_step_end(self, args, state, control, **kwargs):
            if log.state.get("bar") is not None:
                log.state["bar"].advance()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                log.curve.append([float(state.global_step), float(logs["loss"])])

        def on_epoch_end(self, args, state, control, **kwargs):
            e = int(round(state.epoch or 0))
            if e in plan.save_at and e < plan.last_epoch:
                log.saved.append({"name": f"epoch-{e}", "epoch": e, "step": state.global_step,
                                  "learning_rate": log.rates[-1] if log.rates else None})
                save_adapter(kwargs["model"], Path(plan.checkpoint_dir) / f"epoch-{e}",
                             record(e, state.global_step, log.state.get("tfp")), optimizer=kwargs.get("optimizer"))
            if stop_epoch and e >= stop_epoch:
                control.should_training_stop = True
            return control

    return _Record()


def _skipping_trainer(SFTTrainer, excluded: list[int]):
    """SFTTrainer whose optimizer makes no update on a step whose rows are all removed (AdamW would otherwise move
    on its momentum); the schedule steps on."""

    class _Trainer(SFTTrainer):
        def create_optimizer(self, model=None):
            opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
            inner_step = opt.step
            params = [p for g in opt.param_groups for p in g["params"]]

            def step(*a, **k):  # every row of the step removed: no update (the schedule steps on)
                if excluded and all(p.grad is None or not bool(p.grad.any()) for p in params):
                    return None
                return inner_step(*a, **k)

            opt.step = step
            return opt

    return _Trainer


def _initial_model(base, hp: dict, recipe: Optional[Recipe], init_file: Optional[Path], made):
    """(model, peft_config for TRL to wrap it with): the base for TRL to wrap (seeded by TRL), or the base with the
    LoRA weights a callback recorded before the first step, or a factory's model as it is."""
    peft_config = lora_config_of(hp, recipe.lora_config if recipe else None)
    if init_file is not None and init_file.exists() and not made:
        from peft import get_peft_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        model = get_peft_model(base, peft_config)
        set_peft_model_state_dict(model, load_file(str(init_file)))
        return model, None
    return base, (None if made else peft_config)


def trl_trainer(cfg, data: TrlData, plan: TrlPlan, model, peft_config, callback, recipe: Optional[Recipe], quiet):
    """Step 3: the SFTTrainer over every row (removed ones masked by the collator), gradian's bar instead of its
    printers; ModelError when TRL tokenized other data than the recorded run."""
    import datasets

    SFTConfig, SFTTrainer = import_trl()
    with quiet, _trl_errors("setting up"):
        args = SFTConfig(**plan.kw)
        trainer = _skipping_trainer(SFTTrainer, data.excluded)(
            model=model, args=args, train_dataset=datasets.Dataset.from_list(data.rows),
            processing_class=data.tokenizer, peft_config=peft_config, callbacks=[callback])
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for cb in (PrinterCallback, ProgressCallback):  # gradian's own bar instead of per-step log prints
        trainer.remove_callback(cb)
    trainer.data_collator = ExcludingCollator(trainer.data_collator, data.excluded)
    tfp = tokenized_fingerprint(trainer.train_dataset)
    if recipe and recipe.tokenized_fingerprint and recipe.tokenized_fingerprint != tfp:
        raise ModelError(
            f"{cfg.data.train}: TRL's tokenized training set (fingerprint {tfp}) differs from the one the "
            f"recorded run iterated ({recipe.tokenized_fingerprint}): another data file, order, tokenizer or "
            "max_length. verify needs the original data and tokenizer; for a run TRL cannot reproduce, set "
            "train.command to the script that trained it")
    return trainer, tfp


def _steps_to_run(trainer, stop_epoch: Optional[int]) -> int:
    """The optimizer steps this run takes (for the bar)."""
    import math

    args = trainer.args
    if args.max_steps and args.max_steps > 0:
        return int(args.max_steps)
    per_epoch = math.ceil(math.ceil(len(trainer.train_dataset) / args.per_device_train_batch_size)
                          / args.gradient_accumulation_steps)
    return per_epoch * int(math.ceil((stop_epoch or args.num_train_epochs)))


def train_trl(cfg, *, exclude: Iterable[int] = (), out_dir: Optional[Path] = None, recipe: Optional[Recipe] = None,
              progress: bool = True, checkpoint_epochs: Iterable[int] = (), checkpoint_dir: Optional[Path] = None,
              save_checkpoints: Optional[bool] = None, init_file: Optional[Path] = None, model_factory=None,
              backend_name: str = "trl") -> Path:
    """Train a LoRA adapter through TRL's SFTTrainer on data.train minus `exclude` (removed in place); the same
    contract as `training.loop.train_adapter` (checkpoints after `checkpoint_epochs` into `checkpoint_dir/epoch-k`,
    or every earlier epoch inside the output when `save_checkpoints`). `init_file` holds the recorded initial LoRA
    weights of a callback run (`INIT_ADAPTER_FILE`). `model_factory(cfg, hp, seed) -> (peft model, tokenizer)`
    replaces the base and LoRA loading (the unsloth backend)."""
    import torch

    import_trl()
    from ..io import dir_fingerprint
    from ..progress import progress_bar
    from ..setup.model import load_base
    from .loop import save_adapter
    from .trainer_dir import expected_steps

    t0 = time.time()
    data = trl_data(cfg, recipe, exclude, model_factory)
    base = data.made[0] if data.made else load_base(cfg)
    plan = trl_plan(cfg, data, base, recipe, out_dir, progress=progress, checkpoint_epochs=checkpoint_epochs,
                    checkpoint_dir=checkpoint_dir, save_checkpoints=save_checkpoints)
    base_fp = dir_fingerprint(cfg.local_or_hub(cfg.model.base))
    log = TrlLog()

    def record(epoch: int, step: int, tfp: Optional[str]) -> Recipe:
        return trl_recipe(cfg, data, plan, log, recipe, epoch, step, tfp, backend_name=backend_name, base_fp=base_fp,
                          started=t0)

    model, peft_config = _initial_model(base, data.hp, recipe, init_file, data.made)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    quiet = _Quiet()
    try:
        trainer, tfp = trl_trainer(cfg, data, plan, model, peft_config,
                                   _record_callback(plan, log, data.stop_epoch, record, expected_steps(cfg, recipe)),
                                   recipe, quiet)
        log.state["tfp"] = tfp
        n = _steps_to_run(trainer, data.stop_epoch)
        with progress_bar(f"train ({backend_name})", total=n if progress else 0, unit="steps") as b, quiet, \
                _trl_errors("training"):
            log.state["bar"] = b
            trainer.train()
        final = trainer.model
        final.eval()
        step = trainer.state.global_step
        save_adapter(final, plan.out_dir, record(plan.last_epoch, step, tfp), checkpoints=plan.staging,
                     optimizer=trainer.optimizer)
        if plan.save_at and plan.save_at[-1] == plan.last_epoch and plan.staging is None:
            save_adapter(final, Path(plan.checkpoint_dir) / f"epoch-{plan.last_epoch}",
                         record(plan.last_epoch, step, tfp), optimizer=trainer.optimizer)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        shutil.rmtree(plan.work, ignore_errors=True)
    if plan.unknown:
        import logging

        logging.getLogger("gradian").warning("recorded training arguments not in this TRL's SFTConfig, ignored: %s",
                                             ", ".join(plan.unknown))
    return plan.out_dir


class _trl_errors:
    """TRL's and transformers' own errors (a bad argument, a template TRL cannot mask) as one TrainingError that
    says which stage failed; gradian's errors and interrupts pass through."""

    def __init__(self, stage: str):
        self.stage = stage

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        from ..errors import GradianError, TrainingError

        if e is None or isinstance(e, (GradianError, KeyboardInterrupt)) or not isinstance(e, Exception):
            return False
        text = " ".join(str(e).split())
        raise TrainingError(f"train.backend trl: TRL's SFTTrainer failed while {self.stage} ({type(e).__name__}: "
                            f"{text[:400]}); check the recipe's training arguments (train.*, or the trainer_args "
                            "recorded in gradian_recipe.json)") from None


class _Quiet:
    """transformers' and datasets' info chatter and map progress bars off for a block (errors still show)."""

    def __enter__(self):
        import warnings

        import datasets
        from transformers.utils import logging as hf_logging

        self._v = hf_logging.get_verbosity()
        self._bars = datasets.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        datasets.disable_progress_bars()
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")
        return self

    def __exit__(self, *exc):
        import datasets
        from transformers.utils import logging as hf_logging

        self._w.__exit__(*exc)
        hf_logging.set_verbosity(self._v)
        if self._bars:
            datasets.enable_progress_bars()
        return False
