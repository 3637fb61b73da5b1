"""Scores averaged over training checkpoints (TracIn-CP style): `attribution.checkpoints`.

A gradient at the final adapter shows what a row would still teach, not what training on it did: a row the fine-tune
learned early and fits well by the end has a small gradient there, whatever it caused (the format scenario: a third
of the rows that taught the wrong format score as helpful at the final adapter). TracIn sums the test-train inner
products over checkpoints of the run; with a constant learning rate the weights are equal, so Gradian averages each
checkpoint's per-item scores (each with its own index, preconditioner and query gradients).

Where the checkpoints come from, in order:

* ``attribution.checkpoint_adapters``: adapter directories saved during training elsewhere, used as given;
* ``attribution.checkpoints: auto`` (the default): the checkpoints saved with the adapter (`saved_adapters`:
  `gradian train` keeps every earlier epoch in ``ADAPTER/checkpoints/epoch-<k>``; TRL and the HF Trainer write
  ``checkpoint-<step>`` folders), at most `AUTO_MAX` of them evenly spaced; none saved means the final adapter
  alone. Costs one index build per checkpoint and no training;
* ``attribution.checkpoints: N``: N checkpoints, from the saved ones when there are enough, else, when the adapter
  carries a Gradian recipe, ``N - 1`` evenly spaced epochs replayed once from it (deterministic: a checkpoint of
  epoch k is bit-identical to a k-epoch run) and cached under the index directory, keyed by the adapter's
  fingerprint.

The final adapter is always one of the checkpoints, and the one that the exact re-rank, the windows' token ranges, spans
and blame use; each checkpoint ranks a long row by its own best window. How the states' scores combine is
`attribution.states`'; this module finds the states and their weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import ConfigError
from ..io import atomic_write_text, dir_digest, dir_fingerprint

CHECKPOINTS_DIR = "checkpoints"
SEAL_FILE = "gradian_checkpoint.sha256"


def checkpoint_epochs(total: int, count: int) -> list[int]:
    """`count` evenly spaced epochs in 1..total ending at `total` (every epoch when count >= total)."""
    if total < 1 or count < 1:
        raise ValueError("total and count must be >= 1")
    if count >= total:
        return list(range(1, total + 1))
    return sorted({max(1, int(round(total * j / count))) for j in range(1, count + 1)})


def explicit_adapters(cfg) -> list[Path]:
    out = []
    for i, a in enumerate(cfg.attribution.checkpoint_adapters):
        p = cfg.path(a)
        if p is None or not (p / "adapter_config.json").exists():
            raise ConfigError(f"attribution.checkpoint_adapters[{i}] {a!r}: not an adapter directory (no "
                              "adapter_config.json); list the PEFT checkpoint folders saved during training")
        out.append(p)
    return out


def replay_dir(cfg, adapter_path: str, recipe) -> Path:
    from ..training.backends import backend_for

    key = {"adapter": dir_fingerprint(adapter_path), "recipe": recipe.hyperparameters.model_dump(exclude_unset=True),
           "seed": recipe.seed, "data": recipe.dataset_fingerprint}
    backend = backend_for(cfg, recipe)
    if backend != "hf":  # gradian's own replays keep the directory they always had
        key["backend"] = backend
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cfg.index_dir / CHECKPOINTS_DIR / h


def replayed_adapters(cfg, adapter_path: str, count: int, *, progress: bool = True) -> tuple[list[Path], list[int]]:
    """The earlier checkpoints of an adapter with a recipe (gradian train's, the TRL backend's or a
    GradianCallback's), replayed from it once through its backend and cached. A constant rate replays a shorter run;
    a schedule replays the whole run's schedule up to the last epoch needed."""
    from ..training.backends import backend_for, init_file_of, run_training
    from ..training.recipe import read_recipe

    recipe = read_recipe(adapter_path)
    if recipe is None or backend_for(cfg, recipe) == "command":
        return [], []
    total = int(recipe.hyperparameters.epochs)
    epochs = [k for k in checkpoint_epochs(total, count) if k < total]
    if not epochs:
        return [], []
    from .. import distributed as dist_

    root = replay_dir(cfg, adapter_path, recipe)
    paths = [root / f"epoch-{k}" for k in epochs]
    # Under torchrun rank 0 replays (one training run) and the others read its sealed folders.
    if dist_.current().is_main and not all(_intact(p) for p in paths):
        rec = recipe.up_to_epoch(max(epochs))
        excl = recipe.excluded_positions or []
        run_training(cfg, recipe=rec, exclude=excl, out_dir=root / f"epoch-{max(epochs)}", progress=progress,
                     checkpoint_epochs=[k for k in epochs if k < max(epochs)], checkpoint_dir=root,
                     init_file=init_file_of(recipe, adapter_path))
        for p in paths:
            _seal(p)
    dist_.barrier()
    return paths, epochs


def _digest(p: Path) -> str:
    return dir_digest(p, exclude=(SEAL_FILE,))


def _seal(p: Path) -> None:
    atomic_write_text(p / SEAL_FILE, _digest(p))


def _intact(p: Path) -> bool:
    """A replayed checkpoint is reused only when its files still hash to what the replay wrote (a truncated or
    edited cache is replayed again, not trusted)."""
    seal = p / SEAL_FILE
    try:
        return seal.exists() and seal.read_text().strip() == _digest(p)
    except OSError:
        return False


AUTO_MAX = 8  # attribution.checkpoints: auto uses at most this many checkpoints, the final adapter included
_STEP = re.compile(r"^(?:checkpoint|epoch)-(\d+)$")


def saved_adapters(adapter_path: str) -> list[Path]:
    """Earlier checkpoints saved with an adapter, oldest first: `gradian train`'s `ADAPTER/checkpoints/epoch-<k>`,
    a Trainer's `ADAPTER/checkpoint-<step>` (TRL and the HF Trainer write those into their output_dir, where
    `save_model` puts the final adapter), or, when the adapter is itself a `checkpoint-<step>` folder, its siblings
    with a smaller step. Only folders holding an adapter_config.json count."""
    from ..training.loop import CHECKPOINTS_SUBDIR

    root = Path(adapter_path)
    if not root.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    own = _STEP.match(root.name)
    places = [root / CHECKPOINTS_SUBDIR, root] + ([root.parent] if own and own.group(0).startswith("checkpoint") else [])
    for place in places:
        if not place.is_dir():
            continue
        for d in place.iterdir():
            m = _STEP.match(d.name)
            if not m or not (d / "adapter_config.json").is_file() or d.resolve() == root.resolve():
                continue
            if own and place == root.parent and int(m.group(1)) >= int(own.group(1)):
                continue
            found.append((int(m.group(1)), d))
    found.sort(key=lambda x: (x[0], str(x[1])))
    return [p for _, p in found]


def evenly(items: Sequence, k: int) -> list:
    """k items spread evenly over `items`, ending with its last one (all of them when k >= len)."""
    n = len(items)
    if k >= n:
        return list(items)
    if k <= 0:
        return []
    return [items[max(0, int(round(n * j / k)) - 1)] for j in range(1, k + 1)]


def _weights_file(p: Path) -> Optional[Path]:
    for f in ("adapter_model.safetensors", "adapter_model.bin"):
        if (Path(p) / f).is_file():
            return Path(p) / f
    return None


def without_final(saved: Sequence[Path], adapter_path: str) -> list[Path]:
    """The saved checkpoints but any whose weights are byte-identical to the final adapter's (a Trainer's last
    `checkpoint-<step>` is the adapter `save_model` writes): the final adapter is counted once."""
    from ..io import sha256_file

    final = _weights_file(Path(adapter_path))
    if final is None:
        return list(saved)
    digest, size = None, final.stat().st_size
    out = []
    for p in saved:
        f = _weights_file(p)
        if f is not None and f.stat().st_size == size:
            digest = digest or sha256_file(final)
            if sha256_file(f) == digest:
                continue
        out.append(p)
    return out


def resolve(n, explicit: Sequence[Path], adapter_path: str, replay: Callable[[int], tuple[list[Path], list[int]]]
            ) -> tuple[list[Path], list[str], list[tuple]]:
    """(earlier checkpoint adapters, their labels, flags) that `attribution.checkpoints` `n` (`auto` or N) or
    `attribution.checkpoint_adapters` (`explicit`) average with the final adapter (`attribution.states.TracInAverage`);
    a flag (id, level, message, fix) when none can be had. `replay(n)`: `replayed_adapters` of the run's recipe (the
    edge binds it to the config). `earliest` is `attribution.states.resolve_states`' own."""
    if explicit:
        paths = list(explicit)
        return paths, [p.name for p in paths], []
    saved = without_final(saved_adapters(adapter_path), adapter_path)
    if n == "auto":
        picked = evenly(saved, AUTO_MAX - 1)
        return picked, [p.name for p in picked], []
    if n == "earliest" or n <= 1:
        return [], [], []
    if len(saved) >= n - 1:
        picked = evenly(saved, n - 1)
        return picked, [p.name for p in picked], []
    paths, epochs = replay(n)
    flags = []
    if not paths:
        flags.append(("attribution.no_checkpoints", "warning",
                      f"attribution.checkpoints is {n} but the adapter has no Gradian recipe to replay (or trained for "
                      "one epoch); scores use the final adapter only",
                      "list the checkpoint folders saved during training in attribution.checkpoint_adapters, or train "
                      "with `gradian train`"))
    return paths, [f"epoch-{k}" for k in epochs], flags


def earliest_saved(adapter_path: str) -> Optional[Path]:
    """The earliest saved checkpoint that is not the final adapter (`attribution.checkpoints: earliest`), or None."""
    saved = without_final(saved_adapters(adapter_path), adapter_path)
    return saved[0] if saved else None


@dataclass(frozen=True)
class Earlier:
    """The earlier states `attribution.checkpoints` asks for, read in one call (`earlier_states`): their adapters and
    labels, flags where none can be had, their TracIn-CP weights and where the weights and the states came from."""

    paths: tuple[Path, ...]
    labels: tuple[str, ...]
    flags: tuple = ()
    weights: Optional[list[float]] = None
    weights_source: str = ""
    source: str = ""


def earlier_states(n, explicit: Sequence[Path], adapter_path: str,
                   replay: Callable[[int], tuple[list[Path], list[int]]]) -> Earlier:
    """`resolve`'s earlier states with their weights (`checkpoint_weights`) and their source (`source_of`):
    `attribution.states.resolve_states` asks this module once."""
    paths, labels, flags = resolve(n, explicit, adapter_path, replay)
    if not paths:
        return Earlier((), (), tuple(flags))
    weights, weights_source = checkpoint_weights(adapter_path, paths)
    return Earlier(tuple(paths), tuple(labels), tuple(flags), weights, weights_source,
                   source_of(bool(explicit), paths, adapter_path))


def average(final: np.ndarray, earlier: Sequence[np.ndarray], weights: Optional[Sequence[float]] = None) -> np.ndarray:
    """Mean of the final checkpoint's scores and the earlier ones', weighted by `weights` ([earlier..., final], the
    learning rate each checkpoint stands for: TracIn-CP). Equal weights (or none) give the plain mean, computed as
    `(final + sum(earlier)) / (1 + len(earlier))` bit for bit."""
    if weights is None or len(set(float(w) for w in weights)) <= 1:
        return (np.asarray(final, dtype=np.float64) + sum(np.asarray(e, dtype=np.float64) for e in earlier)) / (
            1 + len(earlier))
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(earlier) + 1,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be {len(earlier) + 1} finite non-negative numbers with a positive sum")
    parts = [np.asarray(e, dtype=np.float64) for e in earlier] + [np.asarray(final, dtype=np.float64)]
    return sum(wi * x for wi, x in zip(w, parts)) / w.sum()


def _step_of(p: Path) -> Optional[int]:
    """The optimizer step a checkpoint was saved at: its recipe's `step`, a `checkpoint-<step>` name, or its
    trainer_state.json."""
    rec = _recipe_of(p)
    if rec is not None and rec.step:
        return int(rec.step)
    m = _STEP.match(Path(p).name)
    if m and Path(p).name.startswith("checkpoint"):
        return int(m.group(1))
    st = _trainer_state(p)
    return int(st["global_step"]) if st and st.get("global_step") else None


def _recipe_of(p) -> Optional[object]:
    """The Gradian recipe saved with an adapter, or None where there is none or it cannot be read: a broken recipe
    only costs the weighting."""
    from ..training.recipe import read_recipe

    try:
        return read_recipe(p)
    except Exception:
        return None


def _trainer_state(p: Path) -> Optional[dict]:
    f = Path(p) / "trainer_state.json"
    try:
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
    except (OSError, ValueError):
        return None


def _rates_from_states(paths: Sequence[Path]) -> Optional[list[float]]:
    """Per-step rates rebuilt from the most complete trainer_state.json log_history (rates logged every
    `logging_steps`; each step takes the rate logged last at or before it, the first logged one before that)."""
    best = None
    for p in paths:
        st = _trainer_state(p)
        if st and (best is None or st.get("global_step", 0) > best.get("global_step", 0)):
            best = st
    if not best:
        return None
    logged = sorted((int(h["step"]), float(h["learning_rate"])) for h in best.get("log_history", [])
                    if "learning_rate" in h and "step" in h)
    total = int(best.get("max_steps") or best.get("global_step") or 0)
    if not logged or total <= 0:
        return None
    out, j = [], 0
    for s in range(1, total + 1):
        while j + 1 < len(logged) and logged[j + 1][0] <= s:
            j += 1
        out.append(logged[j][1])
    return out


def interval_means(rates: Sequence[float], steps: Sequence[int]) -> list[float]:
    """TracIn-CP's weights: the mean learning rate of the steps each checkpoint stands for. Checkpoint i, saved after
    step `steps[i]` (ascending), covers steps (steps[i-1], steps[i]] (the first from step 1). With a constant rate
    every mean is that rate, whatever the spacing."""
    out, prev = [], 0
    for t in steps:
        t = int(t)
        seg = list(rates[prev:t]) if t > prev else []
        if not seg:  # a checkpoint past the recorded steps, or two at one step: the nearest recorded rate
            seg = [rates[min(max(t, 1), len(rates)) - 1]] if len(rates) else []
        if not seg:
            out.append(float("nan"))
        else:  # an exactly constant stretch keeps its rate bit for bit (sum / n can round it)
            out.append(float(seg[0]) if all(x == seg[0] for x in seg) else float(sum(seg) / len(seg)))
        prev = max(prev, t)
    return out


def checkpoint_weights(adapter_path: str, paths: Sequence[Path]) -> tuple[Optional[list[float]], str]:
    """TracIn-CP weights of [earlier..., final]: the mean learning rate of the optimizer steps each checkpoint
    stands for (those since the previous checkpoint), from the adapter's recipe (`learning_rates`: gradian train,
    the TRL backend, GradianCallback) or else a Trainer's trainer_state.json; (None, why) when neither says."""
    rec = _recipe_of(adapter_path)
    steps = [_step_of(p) for p in paths]
    final_step = (rec.step if rec is not None and rec.step else None) or _step_of(Path(adapter_path))
    rates, source = None, ""
    if rec is not None and rec.learning_rates:
        rates, source = list(rec.learning_rates), f"the recorded rate of each step ({Path(adapter_path) / 'gradian_recipe.json'})"
        final_step = final_step or len(rates)
    else:
        rates = _rates_from_states([Path(adapter_path), *paths])
        source = "trainer_state.json log_history (rates logged every logging_steps)"
        if rates is not None:
            final_step = final_step or len(rates)
    if rates is None or final_step is None or any(t is None for t in steps):
        return None, "equal: no learning rates were recorded with these checkpoints"
    order = steps + [final_step]
    if sorted(order) != order:
        return None, "equal: the checkpoints' steps are not in training order"
    return interval_means(rates, order), source


def source_of(explicit: bool, paths: Sequence[Path], adapter_path: str) -> str:
    """Where the earlier states came from, in the report's words."""
    if explicit:
        return "attribution.checkpoint_adapters"
    return "saved" if all(_is_saved(p, adapter_path) for p in paths) else "replayed"


def _is_saved(p: Path, adapter_path: str) -> bool:
    return any(Path(p).resolve() == q.resolve() for q in saved_adapters(adapter_path))
