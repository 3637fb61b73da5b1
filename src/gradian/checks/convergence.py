"""`train.not_converged`: influence estimates assume the fine-tune sits near an optimum of its training loss.

Two measurements, the first that applies:

* **The recorded loss curve** (`gradian train` and the TRL backend record one point per step, `GradianCallback`
  the logged ones, in `gradian_recipe.json`; without a recipe, the `log_history` of the `trainer_state.json` a
  Trainer writes into its last `checkpoint-*` folder), for runs of `MIN_EPOCHS` or more epochs: the mean loss of
  each epoch (every epoch sees every row once, so the means compare like for like; per-step losses swing with which
  rows a batch holds) and the share of the whole descent made in the last epoch. Above `CURVE_SHARE`, with the last
  epoch's mean loss still above `FITTED_LOSS` nats per token, the run was stopped mid-descent. A run whose loss is
  already that low fits its rows (a linear or cosine schedule keeps lowering the loss of rows it has learned to the
  last step, so the share alone flags converged fine-tunes: SmolLM2-135M's TRL run, epoch means 0.56 -> 0.26 ->
  0.14, last steps 0.01-0.08).
* **Otherwise**, at the final adapter, over the gradient index `attribute` builds anyway: the agreement
  `|sum_i g_i| / sum_i |g_i|` of the rows' loss gradients. At a stationary point of the training loss they cancel
  (their sum is the gradient of the total loss); n unrelated rows give about 1/sqrt(n); an under-trained adapter's
  rows still pull one way. Flagged above `GRADIENT_Z` / sqrt(n).

Measured on the demo (300 rows; docs/demos.md): the 8-epoch fine-tunes (gradian's loop, the TRL backend, a TRL
cosine run) made 0.3-2.8% of their descent in the last epoch and have agreement 1.4 / sqrt(n); stopped after 3
epochs, 64%; after 1 epoch (at the demo's rate and at a fifth of it) the agreement is 4.1-4.9 / sqrt(n).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from .registry import Outcome, check, failed, passed, skipped

CURVE_SHARE = 0.1
FITTED_LOSS = 0.3  # nats per token (74% per token): below it the rows are fitted, whatever the last epoch's share
GRADIENT_Z = 2.0  # measured on the 48-row tiny run: 2.2-3.0 after one epoch (any rate), 0.9 after 12
MIN_EPOCHS = 3
FIX = ("train longer (more epochs or a higher learning rate) until the training loss flattens, or attribute a "
       "checkpoint from the flat part of the run; influence scores of a model far from its optimum rank rows by "
       "what they would still teach, not by what they taught")


def epoch_means(curve: Sequence[Sequence[float]], epochs: int, total_steps: Optional[int]) -> list[float]:
    """Mean recorded loss of each epoch (each epoch sees every row once, so their means compare like for like)."""
    pts = [(float(c[0]), float(c[1])) for c in curve if c is not None and len(c) > 1 and np.isfinite(c[1])]
    if not pts or epochs < 1:
        return []
    total = float(total_steps or max(s for s, _ in pts))
    per = total / epochs
    by: dict[int, list[float]] = {}
    for step, loss in pts:
        by.setdefault(min(epochs, max(1, int(np.ceil(step / per)))), []).append(loss)
    return [float(np.mean(by[e])) for e in sorted(by)]


def curve_share(means: Sequence[float]) -> Optional[float]:
    """Share of the run's whole descent (first epoch's mean loss to the last's) made in its last epoch; None with
    fewer than `MIN_EPOCHS` epochs (the first epoch's mean holds the initial descent, so two epochs always give 1)."""
    if len(means) < MIN_EPOCHS:
        return None
    total = means[0] - means[-1]
    if total <= 0:
        return 1.0
    return max(0.0, (means[-2] - means[-1]) / total)


@dataclass
class Agreement:
    """The running sums behind `gradient_agreement`: the sum of the non-zero rows, the sum of their norms, their
    number. Blocks are added as they come; the sums of several processes add up (`merged`)."""

    total: Optional[np.ndarray] = None
    norms: float = 0.0
    n: int = 0

    def add(self, block: np.ndarray) -> None:
        block = np.asarray(block, dtype=np.float64)
        nz = np.linalg.norm(block, axis=1)
        keep = nz > 0  # a row without supervised tokens has no gradient: it pulls nowhere
        if not keep.any():
            return
        s = block[keep].sum(axis=0)
        self.total = s if self.total is None else self.total + s
        self.norms += float(nz[keep].sum())
        self.n += int(keep.sum())

    @staticmethod
    def merged(parts: Iterable["Agreement"]) -> "Agreement":
        out = Agreement()
        for p in parts:
            if p.total is not None:
                out.total = p.total if out.total is None else out.total + p.total
                out.norms += p.norms
                out.n += p.n
        return out

    def result(self) -> Optional[tuple[float, int]]:
        """(|sum of rows| / sum of row norms, rows); None without rows."""
        if self.total is None or self.norms <= 0:
            return None
        return float(np.linalg.norm(self.total) / self.norms), self.n


def gradient_agreement(chunks: Iterable[np.ndarray]) -> Optional[tuple[float, int]]:
    """(|sum of rows| / sum of row norms, rows) over row chunks [rows, dim] (zero rows left out); None without
    rows. n unrelated rows of equal norm give about 1/sqrt(n); the flag reads ratio x sqrt(n)."""
    acc = Agreement()
    for block in chunks:
        acc.add(block)
    return acc.result()


def curve_message(share: float, means: Sequence[float], source: str = "") -> str:
    where = f" ({source})" if source else ""
    return (f"the last of {len(means)} epochs still made {share:.0%} of the run's whole descent in training loss "
            f"(epoch means {means[0]:.4f} -> {means[-2]:.4f} -> {means[-1]:.4f}){where}")


def not_converged(share: Optional[float], means: Sequence[float]) -> bool:
    """Stopped mid-descent: the last epoch made more than `CURVE_SHARE` of the descent and its mean loss is still
    above `FITTED_LOSS`."""
    return share is not None and share > CURVE_SHARE and bool(means) and means[-1] > FITTED_LOSS


def gradient_message(ratio: float, n: int) -> str:
    z = ratio * np.sqrt(n)
    return (f"the {n} training rows' loss gradients at the final adapter still pull one way: |sum of gradients| / "
            f"sum of their norms = {ratio:.3f}, {z:.1f} times the 1/sqrt(n) of unrelated rows (near 0 at an optimum; "
            f"above {GRADIENT_Z:g} times is flagged)")


@check("train.not_converged", "warning",
       meaning=f"The fine-tune looks far from an optimum of its training loss, which influence scores assume: its "
               f"last epoch still made more than {CURVE_SHARE:.0%} of the recorded loss curve's whole descent (runs "
               f"of {MIN_EPOCHS}+ epochs; gradian_recipe.json, else a Trainer's trainer_state.json) while its mean "
               f"loss is still above {FITTED_LOSS} nats per token, or, without such a curve, `attribute` finds the rows' gradients at the "
               f"final adapter pulling one way (|sum g_i| / sum |g_i| above {GRADIENT_Z:g} / sqrt(rows)).",
       fix=FIX)
def _not_converged(ctx) -> Outcome:
    from ..training.recipe import read_recipe

    try:
        path = ctx.adapter_path
    except Exception:  # the adapter's own check reports why it is unavailable
        return skipped("no adapter directory; see model.full_finetune")
    try:
        recipe = read_recipe(path)
    except Exception as e:
        return skipped(f"the adapter's recipe cannot be read ({e})")
    share, means, source = _curve_share(recipe, path)
    if share is None:
        # Nothing to judge before the index exists: not a failure, and `attribute` measures the gradients.
        return passed(f"no loss curve of {MIN_EPOCHS}+ epochs beside the adapter (gradian_recipe.json, or a "
                      "Trainer's checkpoint-*/trainer_state.json) to judge here; `gradian attribute` measures the "
                      "agreement of the rows' gradients at the final adapter")
    msg = curve_message(share, means, source)
    if not_converged(share, means):
        return failed(msg)
    if share > CURVE_SHARE:
        msg += f"; the last epoch's mean loss is {means[-1]:.3f} nats per token, under {FITTED_LOSS}: the rows are fitted"
    return passed(msg)


def _recipe_share(recipe) -> tuple[Optional[float], list[float]]:
    if recipe is None or not recipe.loss_curve:
        return None, []
    means = epoch_means(recipe.loss_curve, int(recipe.hyperparameters.epochs), recipe.total_steps)
    return curve_share(means), means


def trainer_state_curve(adapter_path) -> Optional[tuple[list[list[float]], int, Optional[int], str]]:
    """(loss curve [[step, loss]], epochs, total steps, file) from the `trainer_state.json` of the last
    `checkpoint-*` folder a transformers Trainer saved inside the adapter directory or beside it; None without
    one."""
    import json
    import math
    import re
    from pathlib import Path

    if adapter_path is None:
        return None
    p = Path(adapter_path)
    found = []
    for d in (p, p.parent):
        if d.is_dir():
            for c in d.glob("checkpoint-*"):
                m = re.fullmatch(r"checkpoint-(\d+)", c.name)
                if m and (c / "trainer_state.json").exists():
                    found.append((int(m.group(1)), c / "trainer_state.json"))
        if found:
            break
    if not found:
        return None
    f = max(found)[1]
    try:
        st = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    curve = [[float(h["step"]), float(h["loss"])] for h in st.get("log_history") or []
             if isinstance(h, dict) and "loss" in h and "step" in h]
    epochs = int(math.ceil(float(st.get("num_train_epochs") or 0)))
    if not curve or epochs < 1:
        return None
    return curve, epochs, int(st["max_steps"]) if st.get("max_steps") else None, str(f)


def _curve_share(recipe, adapter_path) -> tuple[Optional[float], list[float], str]:
    """(share, epoch means, where the curve came from): the recipe's curve, else a Trainer's trainer_state.json."""
    share, means = _recipe_share(recipe)
    if share is not None:
        return share, means, "gradian_recipe.json"
    got = trainer_state_curve(adapter_path)
    if got is None:
        return None, [], ""
    curve, epochs, total, f = got
    means = epoch_means(curve, epochs, total)
    return curve_share(means), means, f


def flag_from_index(s, rows) -> Optional[float]:
    """The gradient measurement over an open index's rows, raised as a report flag on the session when it fails;
    only when the adapter has no recorded loss curve (the setup check judged the curve). Returns the ratio."""
    return flag_from_agreement(s, lambda: gradient_agreement(block for _, _, block in rows.chunks()))


def flag_from_agreement(s, measure) -> Optional[float]:
    """`flag_from_index` from `measure()`: the rows' (ratio, n) (`gradient_agreement`), taken only when the adapter
    has no recorded loss curve."""
    from ..training.recipe import read_recipe

    try:
        recipe = read_recipe(s.adapter_path)
    except Exception:
        recipe = None
    if _curve_share(recipe, s.adapter_path)[0] is not None:
        return None
    res = measure()
    if res is None:
        return None
    ratio, n = res
    if ratio * np.sqrt(n) > GRADIENT_Z:
        s.log.flag("train.not_converged", "warning", gradient_message(ratio, n), FIX)
    return ratio
