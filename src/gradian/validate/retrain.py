"""Retraining for `verify` and `fidelity`: the recipe's training run without some rows, and its capability.

Removal is by zero-weighting in place (`training.loop.train_adapter`): the data order is a function of (n, epochs,
batch size, seed) only, so every remaining row keeps its batch and its step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..config import Config
from ..errors import VerifyError
from ..training.recipe import Recipe


def adapters_equal(a: Path, b: Path) -> bool:
    """Every tensor of two saved adapters equal (torch.equal), same names and shapes."""
    import torch
    from safetensors.torch import load_file

    fa, fb = Path(a) / "adapter_model.safetensors", Path(b) / "adapter_model.safetensors"
    if not (fa.exists() and fb.exists()):
        return False
    ta, tb = load_file(str(fa)), load_file(str(fb))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def retrain(cfg: Config, recipe: Recipe, exclude: Sequence[int], out_dir: Path, user_adapter: Path, *,
            progress: bool = True) -> Path:
    """The recipe's adapter trained again without the rows at `exclude`, written to `out_dir` (never into or
    around the user's adapter)."""
    from ..training.loop import train_adapter

    out_dir = Path(out_dir)
    ua = Path(user_adapter).resolve()
    od = out_dir.resolve()
    if od == ua or ua in od.parents or od in ua.parents:
        raise VerifyError(f"{out_dir}: refusing to retrain into or around the user's adapter {user_adapter}")
    return train_adapter(cfg, exclude=list(exclude), out_dir=out_dir, recipe=recipe, progress=progress)


def measure_adapter(cfg: Config, adapter: Path, s) -> tuple[list[float], list[str]]:
    """Per-item scores and answers of a retrained adapter on the session's eval items, generated exactly as the
    fine-tune's were (`capability.evaluate.item_scores`). The model is loaded for this and freed after it."""
    from ..capability.evaluate import item_scores
    from ..setup.model import load_model

    e = cfg.evaluation
    model = load_model(cfg, str(adapter))
    try:
        return item_scores(model, s.tokenizer, s.eval_items, metric=e.metric, chat=s.chat,
                           max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, max_len=cfg.grads.max_seq_length,
                           desc="retrained answers")
    finally:
        del model
