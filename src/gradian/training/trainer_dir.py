"""The recipe of a TRL / HF `Trainer` output dir that has no `gradian_recipe.json` (trained without
`GradianCallback`), read from what the Trainer wrote, with nothing from the dir executed:

* `training_args.bin` (written by `trainer.save_model`, and into every `checkpoint-*`): the learning rate and
  schedule, warm-up, epochs or max_steps, batch size, accumulation, optimizer, clipping, seeds, max_length and the
  loss masks, read by `safe_args.read_training_args` (a pickle, never executed);
* `adapter_config.json`: LoRA rank, alpha, dropout and target modules (and the base the adapter names);
* `trainer_state.json` (in the dir after `trainer.save_state()`, else in the newest `checkpoint-*`): the run's
  optimizer steps, which a retrain must take too (`expected_steps`: another data file, batch size or number of
  processes gives another count, and the retrain stops before its first step).

The recipe retrains through TRL's `SFTTrainer` with those arguments (`train.backend: trl`): the same schedule, the
same seed (TRL seeds the LoRA initialisation with it) and the same `RandomSampler` data order. A field the files do
not hold stops with a `VerifyError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import VerifyError
from .recipe import RECIPE_FILE, SCHEMA, Recipe, load_recipe
from .trainer_args import TRAINER_ARG_KEYS

ARGS_FILE = "training_args.bin"
STATE_FILE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
ORIGIN = "trainer_dir"
# What a retrain cannot do without, and what each is for (a missing one is named in the error).
REQUIRED_ARGS = {"learning_rate": "the peak learning rate", "lr_scheduler_type": "the schedule",
                 "num_train_epochs": "the epochs", "max_steps": "the step limit (-1: none)",
                 "per_device_train_batch_size": "the batch size", "seed": "the data order and LoRA initialisation"}
REQUIRED_LORA = {"r": "the LoRA rank", "lora_alpha": "the LoRA alpha", "target_modules": "the modules it wraps"}
_SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}


def _step_of(p: Path) -> int:
    m = re.fullmatch(r"checkpoint-(\d+)", p.name)
    return int(m.group(1)) if m else -1


def newest_file(adapter: Path, name: str) -> Optional[Path]:
    """`adapter/name`, else the one in the `checkpoint-*` folder of the highest step, else None."""
    if (adapter / name).is_file():
        return adapter / name
    cks = sorted((p for p in adapter.glob("checkpoint-*") if _step_of(p) >= 0 and (p / name).is_file()),
                 key=_step_of)
    return cks[-1] / name if cks else None


def has_trainer_args(adapter: str | Path) -> bool:
    return Path(adapter).is_dir() and newest_file(Path(adapter), ARGS_FILE) is not None


def _missing(where: Path, fields: list[str], what: dict[str, str]) -> VerifyError:
    names = ", ".join(f"{f} ({what[f]})" for f in fields)
    return VerifyError(f"{where}: has no {names}, which a retrain needs; write {where.parent / RECIPE_FILE} "
                       f"with the recipe instead (`gradian verify` says which fields without it), or train with "
                       "gradian.integrations.GradianCallback, which records it")


def read_args(path: Path) -> dict[str, Any]:
    """training_args.bin's fields (`safe_args.read_training_args`); VerifyError naming the file otherwise."""
    from .safe_args import UnsafePickle, read_training_args

    try:
        args = read_training_args(path)
    except UnsafePickle as e:
        raise VerifyError(f"{path}: refused, not loaded: {e}. A Trainer writes only its arguments there; replace the "
                          f"file with the run's own, or write {path.parent / 'gradian_recipe.json'}") from None
    except (OSError, ValueError) as e:
        raise VerifyError(f"{path}: cannot be read as the Trainer's arguments ({e}); write "
                          f"{path.parent / 'gradian_recipe.json'} with the recipe instead") from None
    missing = [k for k in REQUIRED_ARGS if args.get(k) is None]
    if missing:
        raise _missing(path, missing, REQUIRED_ARGS)
    return args


def read_lora(adapter: Path) -> dict[str, Any]:
    path = adapter / ADAPTER_CONFIG
    try:
        lora = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise VerifyError(f"{path}: not found; model.adapter must be the PEFT LoRA adapter the run saved") from None
    except (OSError, ValueError) as e:
        raise VerifyError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(lora, dict) or str(lora.get("peft_type", "LORA")).upper() != "LORA":
        raise VerifyError(f"{path}: not a LoRA adapter config (peft_type {lora.get('peft_type')!r})")
    missing = [k for k in REQUIRED_LORA if lora.get(k) in (None, [], "")]
    if missing:
        raise _missing(path, missing, REQUIRED_LORA)
    lora = dict(lora)
    lora["inference_mode"] = False  # saved for inference; a retrain trains it
    return lora


def read_state(adapter: Path) -> tuple[Optional[Path], dict]:
    path = newest_file(adapter, STATE_FILE)
    if path is None:
        return None, {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise VerifyError(f"{path}: cannot be read as JSON ({e}); delete it (it is optional) or restore it") from None
    return path, state if isinstance(state, dict) else {}


def loss_mode(args: dict, shape: Optional[str]) -> str:
    """"supervised" or "all", as TRL trained records of this shape under these arguments: a conversation is
    masked to its assistant turns only with assistant_only_loss, a prompt-completion record to its completion unless
    completion_only_loss is False, a text record never."""
    if args.get("assistant_only_loss"):
        return "supervised"
    if shape in ("prompt_completion", "conversation_completion") and args.get("completion_only_loss") is not False:
        return "supervised"
    return "all"


def _warmup(args: dict, total: Optional[int]) -> int:
    w = args.get("warmup_steps") or 0
    if w >= 1:
        return int(w)
    ratio = w or args.get("warmup_ratio") or 0.0  # a fraction of the run (warmup_ratio, or warmup_steps < 1)
    return int(math.ceil(ratio * total)) if ratio and total else 0


def trainer_dir_recipe(adapter: str | Path, *, shape: Optional[str] = None) -> tuple[Recipe, Path]:
    """(the recipe, the training_args.bin it came from) of a Trainer output dir; VerifyError naming the file and
    field when something a retrain needs is not there. `shape`: the training records' shape (for the loss mask)."""
    adapter = Path(adapter)
    args_path = newest_file(adapter, ARGS_FILE)
    if args_path is None:
        raise VerifyError(f"{adapter / ARGS_FILE}: not found (nor in a checkpoint-* folder)")
    args = read_args(args_path)
    lora = read_lora(adapter)
    state_path, state = read_state(adapter)
    if state_path is not None and state_path.parent == adapter and state.get("max_steps") \
            and state.get("global_step") not in (None, state["max_steps"]):  # (a checkpoint's state may be earlier)
        raise VerifyError(f"{state_path}: the adapter is the state after step {state['global_step']} of "
                          f"{state['max_steps']}; verify retrains a finished run: point model.adapter at the run's "
                          "output dir (the final adapter trainer.save_model wrote)")
    trainer_args = {k: args[k] for k in TRAINER_ARG_KEYS if k in args}
    total = int(state["max_steps"]) if state.get("max_steps") else None
    tm = lora["target_modules"]
    hp = {
        "learning_rate": float(args["learning_rate"]), "epochs": int(math.ceil(float(args["num_train_epochs"]))),
        "batch_size": int(args["per_device_train_batch_size"]),
        "gradient_accumulation_steps": int(args.get("gradient_accumulation_steps") or 1),
        "lr_scheduler": _SCHEDULES.get(str(args["lr_scheduler_type"]), str(args["lr_scheduler_type"])),
        "warmup_steps": _warmup(args, total), "weight_decay": float(args.get("weight_decay") or 0.0),
        "max_grad_norm": args.get("max_grad_norm") or None, "max_seq_length": int(args.get("max_length") or 1024),
        "loss": loss_mode(args, shape), "lora_r": int(lora["r"]), "lora_alpha": float(lora["lora_alpha"]),
        "lora_dropout": float(lora.get("lora_dropout") or 0.0),
        "target_modules": sorted(tm) if isinstance(tm, (list, tuple)) else [str(tm)],
    }
    files = [str(args_path), str(adapter / ADAPTER_CONFIG)] + ([str(state_path)] if state_path else [])
    recipe = Recipe.model_validate({
        "schema": SCHEMA, "backend": "trl", "seed": int(args["seed"]), "hyperparameters": hp,
        "schedule": (f"read from the {args['__class__'].rsplit('.', 1)[-1]} in {args_path.name}: "
                     f"{args['lr_scheduler_type']} learning rate, {args.get('optim')}"),
        "trainer_args": trainer_args, "lora_config": lora,
        "data_order": (f"the Trainer's RandomSampler after set_seed({args['seed']})"
                       + (f", data_seed {args['data_seed']}" if args.get("data_seed") is not None else "")),
        "base": lora.get("base_model_name_or_path"), "total_steps": total,
        "step": total,  # the adapter is the run's end (a checkpoint as model.adapter is refused above)
        "excluded_positions": [], "origin": ORIGIN, "origin_files": files,
        "trainer_class": args["__class__"],
    })
    return recipe, args_path


def recipe_for_retrain(cfg) -> tuple[Recipe, Path]:
    """The recipe a retrain of model.adapter starts from: its gradian_recipe.json (`recipe.load_recipe`: recorded by
    `gradian train`, the TRL backend or GradianCallback, or written by hand), else, in a Trainer output dir, the
    one the Trainer's files hold (`trainer_dir_recipe`: nothing from the config). VerifyError naming what is
    missing otherwise."""
    adapter = Path(cfg.local_or_hub(cfg.model.adapter, "model.adapter")) if cfg.model.adapter else None
    if adapter is not None and not (adapter / RECIPE_FILE).exists() and has_trainer_args(adapter):
        return trainer_dir_recipe(adapter, shape=_train_shape(cfg))
    return load_recipe(cfg)


def _train_shape(cfg) -> Optional[str]:
    """The shape of data.train's records (one shape: TRL trains one per dataset), or None when it has several."""
    if not cfg.data.train:
        return None
    from ..setup.records import data_location, load_train

    shapes = {e.shape for e in load_train(data_location(cfg, cfg.data.train))}
    return shapes.pop() if len(shapes) == 1 else None


def expected_steps(cfg, recipe: Optional[Recipe]) -> Optional[tuple[int, Callable[[int], str]]]:
    """(the optimizer steps the run took, the error for a retrain that would take another number) for a recipe read
    from a Trainer output dir (its trainer_state.json's max_steps); None when there is nothing to check against."""
    if recipe is None or recipe.origin != ORIGIN or not recipe.total_steps or recipe.stop_epoch:
        return None
    state = next((f for f in recipe.origin_files or [] if f.endswith(STATE_FILE)), STATE_FILE)
    expected = int(recipe.total_steps)

    def message(steps: int) -> str:
        return (f"{state}: the run took {expected} optimizer steps, but TRL's SFTTrainer over {cfg.data.train} with "
                f"the run's arguments takes {steps}: the training data is not the file the run read (other rows or "
                "filtering), or the run spread its batches over several processes or GPUs. verify needs the exact "
                "data the run read and a one-process run (or a recorded recipe: gradian.integrations.GradianCallback)")

    return expected, message
