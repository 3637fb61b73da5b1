"""`GradianCallback`: what a transformers `Trainer` / TRL `SFTTrainer` run needs to record for gradian.

Add it to the trainer (`callbacks=[GradianCallback()]`); it writes `gradian_recipe.json` into `args.output_dir`
(where `trainer.save_model()` puts the final adapter) when training starts, at every save and at the end:

* the recipe: the training arguments that decide the weights (`training.trl.TRAINER_ARG_KEYS`: rate, schedule and
  warm-up, epochs, batch size, accumulation, optimizer, clipping, seeds, max_length, loss masks, ...), the LoRA
  config, and the same settings as gradian's own `hyperparameters`;
* the data order: the Trainer's `RandomSampler`, a function of `seed` (and `data_seed`) and the dataset length, and
  a fingerprint of the tokenized training set it iterates (`tokenized_fingerprint`), which a TRL retrain checks;
* the LoRA weights before the first step (`gradian_init_adapter.safetensors`): a retrain starts from them whatever
  seeded the initialisation;
* the rate of every optimizer step, the logged loss curve, and each saved checkpoint (`checkpoint-<step>`) with
  its step and rate, which `attribution.checkpoints` weights by (TracIn-CP) and `train.not_converged` reads.

`gradian attribute` then finds the checkpoints, and `gradian verify` retrains through `train.backend: trl` from
this recipe without the user writing it again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback

from ..io import atomic_write_text
from ..training.recipe import RECIPE_FILE, SCHEMA
from ..training.trl import INIT_ADAPTER_FILE, recorded_args, tokenized_fingerprint

_SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}


class GradianCallback(TrainerCallback):
    """Records the recipe, data order, initial LoRA weights, per-step rates, loss curve and checkpoints of a
    Trainer run into `output_dir` (default: the trainer's `args.output_dir`)."""

    def __init__(self, output_dir: Optional[str] = None):
        self.output_dir = output_dir
        self.rates: list[float] = []
        self.curve: list[list[float]] = []
        self.checkpoints: list[dict] = []
        self.recipe: dict[str, Any] = {}

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if not state.is_world_process_zero:
            return
        out = self._out(args)
        out.mkdir(parents=True, exist_ok=True)
        lora = _lora_config(model)
        targs = recorded_args(args)
        dataset = getattr(train_dataloader, "dataset", None)
        try:
            tfp = tokenized_fingerprint(dataset) if dataset is not None and "input_ids" in dataset.column_names else None
        except (AttributeError, TypeError, KeyError):
            tfp = None
        init = None
        if lora is not None:
            from peft import get_peft_model_state_dict
            from safetensors.torch import save_file

            sd = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
            save_file(sd, str(out / INIT_ADAPTER_FILE))
            init = INIT_ADAPTER_FILE
        sched = str(targs.get("lr_scheduler_type", "linear"))
        epochs = int(math.ceil(state.num_train_epochs or args.num_train_epochs or 1))
        hp = {
            "learning_rate": args.learning_rate, "epochs": epochs,
            "batch_size": args.per_device_train_batch_size * max(1, args.world_size),
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "lr_scheduler": _SCHEDULES.get(sched, sched), "warmup_steps": int(args.get_warmup_steps(state.max_steps)),
            "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm or None,
            "max_seq_length": int(getattr(args, "max_length", None) or 1024),
            "loss": _loss_mode(dataset, args),
        }
        if lora is not None:
            tm = lora.get("target_modules")
            hp.update({"lora_r": lora.get("r"), "lora_alpha": lora.get("lora_alpha"),
                       "lora_dropout": lora.get("lora_dropout", 0.0),
                       "target_modules": sorted(tm) if isinstance(tm, (list, set, tuple)) else [tm]})
        self.recipe = {
            "schema": SCHEMA, "backend": "trl", "seed": int(args.seed), "hyperparameters": hp,
            "schedule": f"Trainer run recorded by GradianCallback: {sched} learning rate, {targs.get('optim')}",
            "trainer_args": targs, "lora_config": lora, "init_adapter": init, "tokenized_fingerprint": tfp,
            "n_examples": len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None,
            "data_order": (f"the Trainer's RandomSampler after set_seed({args.seed})"
                           + (f", data_seed {args.data_seed}" if args.data_seed is not None else "")),
            "base": (lora or {}).get("base_model_name_or_path"), "total_steps": int(state.max_steps),
            "excluded_positions": [],
        }
        self._write(args, state)

    def on_pre_optimizer_step(self, args, state, control, lr_scheduler=None, optimizer=None, **kwargs):
        if lr_scheduler is not None:
            self.rates.append(float(lr_scheduler.get_last_lr()[0]))
        elif optimizer is not None:
            self.rates.append(float(optimizer.param_groups[0]["lr"]))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.curve.append([float(state.global_step), float(logs["loss"])])

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        step = int(state.global_step)
        self.checkpoints.append({"name": f"checkpoint-{step}", "step": step, "epoch": state.epoch,
                                 "learning_rate": self.rates[step - 1] if 0 < step <= len(self.rates) else None})
        self._write(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._write(args, state)

    # ------------------------------------------------------------------ output

    def _out(self, args) -> Path:
        return Path(self.output_dir or args.output_dir)

    def _write(self, args, state) -> None:
        if not self.recipe:
            return
        rec = {**self.recipe, "step": int(state.global_step), "learning_rates": list(self.rates),
               "loss_curve": [list(c) for c in self.curve], "checkpoints": [dict(c) for c in self.checkpoints]}
        atomic_write_text(self._out(args) / RECIPE_FILE, json.dumps(rec, indent=2, default=_json_default))


def _loss_mode(dataset, args) -> str:
    """"supervised" when the prepared training set masks some tokens out of the loss (labels -100: TRL's
    completion_only_loss, on by default for prompt-completion data, or assistant_only_loss), else "all" (TRL's
    default for `messages` and `text` data); from the arguments when the dataset is not at hand."""
    try:
        labels = dataset["labels"] if dataset is not None and "labels" in dataset.column_names else None
    except (AttributeError, TypeError, KeyError):
        labels = None
    if labels is not None:
        return "supervised" if any(-100 in list(lab) for lab in labels) else "all"
    if getattr(args, "assistant_only_loss", False) or getattr(args, "completion_only_loss", None):
        return "supervised"
    return "all"


def _lora_config(model) -> Optional[dict]:
    cfgs = getattr(model, "peft_config", None)
    if not cfgs:
        return None
    c = cfgs.get("default") or next(iter(cfgs.values()))
    d = c.to_dict()
    return json.loads(json.dumps(d, default=_json_default))


def _json_default(o):
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "value"):
        return o.value
    return str(o)
