"""One dispatch for every training run: `gradian train`, verify's and fidelity's retrains, checkpoint replays.

The backend of a run is `train.command` when set, else `train.backend` when the config sets it, else the backend
the adapter's recipe was recorded with (`gradian train` writes `hf`, the TRL backend and `GradianCallback` write
`trl`), else `hf`:

* ``hf``: gradian's own deterministic loop (`training.loop`);
* ``trl``: TRL's `SFTTrainer` (`training.trl`), deterministic on CPU, rows removed in place;
* ``unsloth``: unsloth's `FastLanguageModel` on an NVIDIA GPU (`training.unsloth`);
* ``command``: any script (`training.command`), rows removed from the file it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from .recipe import Recipe

BACKENDS = ("hf", "trl", "unsloth", "command")
# Backends whose retrains keep every other row in its batch and step (removal in place) and replay bit for bit on
# CPU; a command reshuffles what it is given.
IN_PLACE = {"hf": True, "trl": True, "unsloth": True, "command": False}


def backend_for(cfg, recipe: Optional[Recipe] = None) -> str:
    if cfg.train.command:
        return "command"
    if "backend" in cfg.train.model_fields_set or recipe is None:
        return cfg.train.backend
    return recipe.backend if recipe.backend in BACKENDS else "hf"


def run_training(cfg, *, backend: Optional[str] = None, recipe: Optional[Recipe] = None, exclude: Iterable[int] = (),
                 out_dir: Optional[Path] = None, progress: bool = True, checkpoint_epochs: Iterable[int] = (),
                 checkpoint_dir: Optional[Path] = None, save_checkpoints: Optional[bool] = None,
                 init_file: Optional[Path] = None, log_path: Optional[Path] = None, label: str = "train",
                 recorder=None) -> Path:
    """Train (or retrain from `recipe`) with the backend `backend_for` picks; returns the adapter directory.
    `recorder` (the AdamW trajectory for `attribution.optimizer: adamw`) is seen by the built-in loop only: other
    backends' optimizers are not ours to watch, and attribute flags the missing trajectory."""
    name = backend or backend_for(cfg, recipe)
    if name == "command":
        from .command import train_command

        if list(checkpoint_epochs):
            from ..errors import TrainingError

            raise TrainingError("train.command cannot replay checkpoints (gradian cannot ask a script for the "
                                "adapter after epoch k); save checkpoints during training and list them in "
                                "attribution.checkpoint_adapters")
        return train_command(cfg, exclude=exclude, out_dir=out_dir, log_path=log_path, label=label, progress=progress)
    kw = dict(exclude=exclude, out_dir=out_dir, recipe=recipe, progress=progress, checkpoint_epochs=checkpoint_epochs,
              checkpoint_dir=checkpoint_dir, save_checkpoints=save_checkpoints)
    if name == "trl":
        from .trl import train_trl

        return train_trl(cfg, init_file=init_file, **kw)
    if name == "unsloth":
        from .unsloth import train_unsloth

        return train_unsloth(cfg, **kw)
    from .loop import train_adapter

    return train_adapter(cfg, recorder=recorder, **kw)


def init_file_of(recipe: Optional[Recipe], adapter_dir) -> Optional[Path]:
    """The initial LoRA weights a GradianCallback recorded beside the adapter's recipe, if any."""
    if recipe is None or not recipe.init_adapter:
        return None
    p = Path(adapter_dir) / recipe.init_adapter
    return p if p.is_file() else None
