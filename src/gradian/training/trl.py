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

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import ConfigError, DataError, ModelError
from .recipe import Recipe

TRL_EXTRA = "pip install 'gradian[trl]'  (TRL >= 1.16)"
INIT_ADAPTER_FILE = "gradian_init_adapter.safetensors"
POSITION = "gradian_position"

# The training arguments that decide the weights (recorded by the callback, replayed by this backend).
TRAINER_ARG_KEYS = (
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "num_train_epochs",
    "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "weight_decay", "max_grad_norm",
    "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "optim_args", "seed", "data_seed", "full_determinism",
    "bf16", "fp16", "tf32", "gradient_checkpointing", "train_sampling_strategy", "group_by_length",
    "length_column_name", "dataloader_drop_last", "label_smoothing_factor", "neftune_noise_alpha",
    "average_tokens_across_devices", "logging_steps",
    # SFTConfig
    "max_length", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of", "completion_only_loss",
    "assistant_only_loss", "loss_type", "dataset_text_field", "shuffle_dataset", "truncation_mode", "eos_token",
)


def import_trl():
    try:
        import trl  # noqa: F401
        from trl import SFTConfig, SFTTrainer
    except ImportError as e:
        raise ConfigError(f"train.backend: trl needs TRL, which is not installed ({e}); {TRL_EXTRA}") from None
    return SFTConfig, SFTTrainer


def recorded_args(args) -> dict[str, Any]:
    """The training arguments that matter, as JSON values (enums as their names)."""
    d = args.to_dict()
    out = {k: d[k] for k in TRAINER_ARG_KEYS if k in d}
    for k in out:
        if k.endswith("_token"):  # to_dict masks every *_token field (meant for hub tokens) as "<EOS_TOKEN>"
            out[k] = getattr(args, k, None)
    return out


def tokenized_fingerprint(dataset) -> str:
    """Hash of the token ids and labels of a prepared training set, row by row in dataset order."""
    h = hashlib.sha256()
    cols = dataset.column_names
    ids = dataset["input_ids"]
    labels = dataset["labels"] if "labels" in cols else [None] * len(ids)
    for a, b in zip(ids, labels):
        h.update(json.dumps([list(a), list(b) if b is not None else None]).encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ the dataset


def trl_rows(examples, tokenizer, loss: str) -> tuple[list[dict], dict[str, Any]]:
    """The records as TRL reads them (one shape for the whole set), with their positions, and the SFTConfig loss
    settings that supervise what gradian's attribution does (`loss: supervised`) or every token (`all`)."""
    from ..setup.tokenize import _has_generation_tags, has_chat_template

    shapes = sorted({e.shape for e in examples})
    if len(shapes) > 1:
        raise DataError(f"data.train mixes record shapes ({', '.join(shapes)}); TRL trains one shape per dataset: "
                        "rewrite the records to one shape, or use train.backend: hf", check="data.invalid_record")
    shape = shapes[0]
    rows = [{**e.record, POSITION: e.position} for e in examples]
    if loss == "all":
        return rows, {"completion_only_loss": False, "assistant_only_loss": False}
    if shape in ("prompt_completion", "conversation_completion"):
        return rows, {"completion_only_loss": True, "assistant_only_loss": False}
    if shape == "text":
        return rows, {"completion_only_loss": None, "assistant_only_loss": False}
    if has_chat_template(tokenizer) and _has_generation_tags(tokenizer):
        return rows, {"completion_only_loss": None, "assistant_only_loss": True}
    # No {% generation %} tags: TRL cannot mask assistant turns of a conversation, but a conversation whose only
    # assistant turn is the last is the same as a prompt-completion record, whose completion TRL supervises.
    out = []
    for e, r in zip(examples, rows):
        msgs = e.record["messages"]
        if [m["role"] for m in msgs].count("assistant") != 1 or msgs[-1]["role"] != "assistant":
            raise DataError(f"{e.source or e.id}: the chat template has no {{% generation %}} tags, so TRL cannot "
                            "supervise assistant turns only of a conversation with an assistant turn before the "
                            "last; add generation tags to the template, or set train.loss: all",
                            check="data.no_chat_template")
        out.append({"prompt": msgs[:-1], "completion": msgs[-1:], POSITION: r[POSITION]})
    return out, {"completion_only_loss": True, "assistant_only_loss": False}


class ExcludingCollator:
    """Wraps the trainer's collator: strips the row positions and the raw record columns, then sets every label of
    an excluded row to -100 (its tokens leave the loss and num_items_in_batch; the batch keeps its rows)."""

    KEEP = ("input_ids", "labels", "seq_lengths", "attention_mask", "position_ids")

    def __init__(self, inner, excluded: Iterable[int]):
        self.inner, self.excluded = inner, set(int(p) for p in excluded)

    def __call__(self, features: list[dict]) -> dict:
        drop = [int(f.get(POSITION, -1)) in self.excluded for f in features]
        batch = self.inner([{k: v for k, v in f.items() if k in self.KEEP} for f in features])
        if any(drop):
            lab = batch["labels"]
            for i, d in enumerate(drop):
                if d:
                    lab[i] = -100
        return batch


# ------------------------------------------------------------------------------------------------ SFTConfig


def sft_arguments(hp: dict, seed: int, recorded: Optional[dict], loss_flags: dict, *, out: Path, device,
                  dtype: str, progress: bool) -> dict[str, Any]:
    """SFTConfig keyword arguments: the recorded run's (callback) or the recipe's, and the settings a retrain
    needs whatever the run used (no reporting, no hub, no checkpoints of the Trainer's own, every column kept)."""
    if recorded:
        kw = dict(recorded)
        if not kw.get("max_steps") or kw["max_steps"] <= 0:
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
        kw["bf16"] = kw.get("bf16") and dtype == "bfloat16"
        kw["fp16"] = False
    return kw


def lora_config_of(hp: dict, recorded: Optional[dict]):
    from peft import LoraConfig

    if recorded:
        fields = set(LoraConfig.__dataclass_fields__)
        kw = {k: v for k, v in recorded.items() if k in fields and k not in ("base_model_name_or_path", "revision",
                                                                              "peft_type", "auto_mapping")}
        kw["task_type"] = "CAUSAL_LM"
        return LoraConfig(**kw)
    return LoraConfig(r=hp["lora_r"], lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"],
                      target_modules=hp["target_modules"], task_type="CAUSAL_LM")


# ------------------------------------------------------------------------------------------------ the run


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

    SFTConfig, SFTTrainer = import_trl()
    from transformers import TrainerCallback

    from ..io import dir_fingerprint
    from ..runtime import seed_everything
    from ..setup.model import load_base, load_tokenizer
    from ..setup.records import data_location, dataset_fingerprint, load_train
    from .loop import CHECKPOINTS_SUBDIR, save_adapter, train_hyperparameters

    t0 = time.time()
    hp = recipe.hp if recipe else train_hyperparameters(cfg)
    seed = int(recipe.seed) if recipe else cfg.seed
    stop_epoch = recipe.stop_epoch if recipe else None
    seed_everything(seed)
    made = model_factory(cfg, hp, seed) if model_factory is not None else None
    tok = made[1] if made else load_tokenizer(cfg)
    examples = load_train(data_location(cfg, cfg.data.train))
    fp = dataset_fingerprint(examples)
    if recipe and recipe.dataset_fingerprint not in (None, fp):
        raise ModelError(f"{cfg.data.train}: the training set differs from the one the recipe was recorded on "
                         f"(fingerprint {fp} vs {recipe.dataset_fingerprint}); verify needs the original data")
    recorded = recipe.trainer_args if recipe else None
    rows, loss_flags = trl_rows(examples, tok, hp.get("loss", "supervised"))
    excluded = sorted(set(int(p) for p in exclude))

    import datasets

    out_dir = Path(out_dir) if out_dir else cfg.adapter_out
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.trl-", dir=out_dir.parent))
    base = made[0] if made else load_base(cfg)
    device = next(base.parameters()).device
    kw = sft_arguments(hp, seed, recorded, loss_flags, out=work / "trainer", device=device, dtype=cfg.model.dtype,
                       progress=progress)
    fields = set(SFTConfig.__dataclass_fields__)
    unknown = sorted(k for k in kw if k not in fields)
    kw = {k: v for k, v in kw.items() if k in fields}
    total_epochs = int(kw.get("num_train_epochs") or hp["epochs"])
    save_at = sorted(set(int(k) for k in checkpoint_epochs))
    if save_checkpoints is None:
        save_checkpoints = recipe is None and cfg.train.save_checkpoints
    staging: Optional[Path] = None
    if save_checkpoints and not save_at and total_epochs > 1:
        staging = work / CHECKPOINTS_SUBDIR
        checkpoint_dir, save_at = staging, list(range(1, total_epochs))
    last_epoch = stop_epoch or total_epochs
    base_fp = dir_fingerprint(cfg.local_or_hub(cfg.model.base))
    rates: list[float] = []
    curve: list[list[float]] = []
    saved: list[dict] = []
    state_box: dict = {}
    bar = None

    def record(epoch: int, step: int, tfp: Optional[str]) -> Recipe:
        scheduled = kw.get("lr_scheduler_type") not in ("constant", "constant_with_warmup")
        stop = epoch if (scheduled and epoch < total_epochs) else stop_epoch
        base_rec = recipe.model_dump(mode="json", by_alias=True, exclude_unset=True) if recipe else {}
        for k in ("stop_epoch", "excluded_positions", "learning_rates", "loss_curve", "checkpoints", "step",
                  "train_seconds", "removal"):
            base_rec.pop(k, None)
        return Recipe.model_validate({
            **base_rec,
            "schema": "gradian.recipe/1", "backend": backend_name, "seed": seed,
            "hyperparameters": {**hp, "epochs": total_epochs if scheduled else epoch},
            "schedule": f"TRL SFTTrainer, {kw.get('lr_scheduler_type')} learning rate, {kw.get('optim')}",
            "trainer_args": {k: v for k, v in kw.items() if k in TRAINER_ARG_KEYS} if not recorded else recorded,
            "data": str(data_location(cfg, cfg.data.train)), "dataset_fingerprint": fp,
            "n_examples": len(examples), "excluded_positions": excluded,
            "removal": "labels of removed rows set to -100 in place: other rows keep their batches and steps",
            "data_order": "the Trainer's RandomSampler after set_seed(seed), over every row",
            "base": cfg.model.base, "base_fingerprint": base_fp,
            "tokenized_fingerprint": tfp, "step": step, "total_steps": state_box.get("max_steps"),
            "learning_rates": list(rates[:step]), "loss_curve": [c for c in curve if c[0] <= step],
            "checkpoints": [dict(c) for c in saved if c["step"] <= step],
            **({"stop_epoch": stop} if stop else {}),
            "train_seconds": round(time.time() - t0, 2),
        })

    class _Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            state_box["max_steps"] = state.max_steps

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            rates.append(float(kwargs["lr_scheduler"].get_last_lr()[0]))

        def on_step_end(self, args, state, control, **kwargs):
            if bar is not None:
                bar.advance()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                curve.append([float(state.global_step), float(logs["loss"])])

        def on_epoch_end(self, args, state, control, **kwargs):
            e = int(round(state.epoch or 0))
            if e in save_at and e < last_epoch:
                saved.append({"name": f"epoch-{e}", "epoch": e, "step": state.global_step,
                              "learning_rate": rates[-1] if rates else None})
                save_adapter(kwargs["model"], Path(checkpoint_dir) / f"epoch-{e}",
                             record(e, state.global_step, state_box.get("tfp")))
            if stop_epoch and e >= stop_epoch:
                control.should_training_stop = True
            return control

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

    peft_config = lora_config_of(hp, recipe.lora_config if recipe else None)
    model, pass_config = base, (None if made else peft_config)
    if init_file is not None and init_file.exists() and not made:
        from peft import get_peft_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        model = get_peft_model(base, peft_config)
        set_peft_model_state_dict(model, load_file(str(init_file)))
        pass_config = None
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    quiet = _Quiet()
    try:
        with quiet, _trl_errors("setting up"):
            args = SFTConfig(**kw)
            trainer = _Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                               processing_class=tok, peft_config=pass_config, callbacks=[_Record()])
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        for cb in (PrinterCallback, ProgressCallback):  # gradian's own bar instead of per-step log prints
            trainer.remove_callback(cb)
        trainer.data_collator = ExcludingCollator(trainer.data_collator, excluded)
        tfp = tokenized_fingerprint(trainer.train_dataset)
        state_box["tfp"] = tfp
        if recipe and recipe.tokenized_fingerprint and recipe.tokenized_fingerprint != tfp:
            raise ModelError(
                f"{cfg.data.train}: TRL's tokenized training set (fingerprint {tfp}) differs from the one the "
                f"recorded run iterated ({recipe.tokenized_fingerprint}): another data file, order, tokenizer or "
                "max_length. verify needs the original data and tokenizer; for a run TRL cannot reproduce, set "
                "train.command to the script that trained it")
        from ..progress import progress_bar

        n = int(trainer.args.max_steps) if trainer.args.max_steps and trainer.args.max_steps > 0 else None
        if n is None:
            import math
            per_epoch = math.ceil(math.ceil(len(trainer.train_dataset) / args.per_device_train_batch_size)
                                  / args.gradient_accumulation_steps)
            n = per_epoch * int(math.ceil((stop_epoch or args.num_train_epochs)))
        with progress_bar(f"train ({backend_name})", total=n if progress else 0, unit="steps") as b, quiet, \
                _trl_errors("training"):
            bar = b
            trainer.train()
        final = trainer.model
        final.eval()
        step = trainer.state.global_step
        save_adapter(final, out_dir, record(last_epoch, step, tfp), checkpoints=staging)
        if save_at and save_at[-1] == last_epoch and staging is None:
            save_adapter(final, Path(checkpoint_dir) / f"epoch-{last_epoch}", record(last_epoch, step, tfp))
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        shutil.rmtree(work, ignore_errors=True)
    if unknown:
        import logging

        logging.getLogger("gradian").warning("recorded training arguments not in this TRL's SFTConfig, ignored: %s",
                                             ", ".join(unknown))
    return out_dir


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
