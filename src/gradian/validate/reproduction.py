"""Does verify's retrain reproduce the user's fine-tune? A retrain that does not is no evidence about the rows it
drops: the accused retrain would differ from the adapter whatever was removed (a hand-written recipe retrained with
another schedule moved the metric by -28 % with random rows removed, and still "confirmed").

Three measures, each against the user's adapter, and the tolerance each must be within (`TOLERANCE`):

* ``weight_distance``: the reference retrain's (nothing dropped) LoRA update against the adapter's, per LoRA
  module ``dW = B @ A`` (the update the module adds to its weight; the LoRA scale is the same on both sides and
  cancels), ``||dW_ref - dW_user|| / ||dW_user||`` over all modules together (Frobenius); ``max_module_distance`` is
  the largest single module's. 0 for a bit-for-bit replay;
* ``reference_gap``: the share of the fine-tune's change the reference retrain moves by itself,
  ``(cap_reference - cap_tuned) / (cap_base - cap_tuned)``;
* ``controls_drift``: the mean over the random controls of ``|cap_control - cap_tuned| / |cap_base - cap_tuned|``:
  dropping a few random rows should leave the fine-tune where it is.

The run is reproduced when every measure taken is within its tolerance. Without a reference retrain
(``--no-reference``) only the controls are measured, and the verdict says so; with neither it is unknown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

TOLERANCE = {"max_weight_distance": 0.05, "max_reference_gap": 0.10, "max_controls_drift": 0.25}


def _pairs(tensors: dict) -> dict[str, tuple]:
    """{module: (A, B)} for every LoRA pair of a saved adapter, other saved tensors (modules_to_save, trainable
    tokens) as {name: (tensor, None)}; float64."""
    out = {}
    for k, t in tensors.items():
        if ".lora_A." in k and k.replace(".lora_A.", ".lora_B.") in tensors:
            b = tensors[k.replace(".lora_A.", ".lora_B.")].double()
            out[k.replace(".lora_A.weight", "").replace(".lora_A.", ".")] = (t.double().reshape(t.shape[0], -1),
                                                                             b.reshape(b.shape[0], -1))
        elif ".lora_B." not in k or k.replace(".lora_B.", ".lora_A.") not in tensors:
            out[k] = (t.double(), None)
    return out


def _squares(x: tuple, y: tuple) -> tuple[float, float]:
    """(||dW_x - dW_y||^2, ||dW_y||^2) for dW = B @ A, through r x r products (never the full update: an 8B model's
    MLP update is 60M numbers); a plain tensor's when B is None."""
    (ax, bx), (ay, by) = x, y
    if bx is None:
        return float(((ax - ay) ** 2).sum()), float((ay ** 2).sum())
    if all(u.shape == v.shape and bool((u == v).all()) for u, v in ((ax, ay), (bx, by))):
        return 0.0, float(((by.T @ by) * (ay @ ay.T)).sum())

    def inner(a1, b1, a2, b2):  # <B1 A1, B2 A2> = tr((B1^T B2)(A2 A1^T))
        return float(((b1.T @ b2) * (a1 @ a2.T)).sum())

    nx, ny, cross = inner(ax, bx, ax, bx), inner(ay, by, ay, by), inner(ax, bx, ay, by)
    return max(nx + ny - 2 * cross, 0.0), ny


def weight_distance(reference: Path, user: Path) -> dict:
    """{"relative", "max_module", "module", "modules"} of the reference retrain's LoRA updates against the user's
    (see the module docstring); {"relative": None, "why": ...} when they cannot be compared."""
    from safetensors.torch import load_file

    fa, fb = Path(reference) / "adapter_model.safetensors", Path(user) / "adapter_model.safetensors"
    if not (fa.exists() and fb.exists()):
        return {"relative": None, "why": f"{fb if not fb.exists() else fa} is missing"}
    pa, pb = _pairs(load_file(str(fa))), _pairs(load_file(str(fb)))
    if pa.keys() != pb.keys() or any(tuple(getattr(u, "shape", ())) != tuple(getattr(v, "shape", ()))
                                     for k in pa for u, v in zip(pa[k], pb[k])):
        return {"relative": None, "why": "the reference retrain's adapter has other LoRA modules or shapes than yours"}
    num = den = 0.0
    worst, worst_name = -1.0, None
    for k in pb:
        d, n = _squares(pa[k], pb[k])
        num, den = num + d, den + n
        r = (d / n) ** 0.5 if n > 0 else (0.0 if d == 0 else float("inf"))
        if r > worst:
            worst, worst_name = r, k
    rel = (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))
    return {"relative": rel, "max_module": worst, "module": worst_name, "modules": len(pb)}


@dataclass(frozen=True)
class Reproduction:
    """Whether verify's retrains reproduce the user's fine-tune, the measures it rests on and the sentence why.
    `reproduced` is None when nothing was measured (no reference retrain, no control)."""

    reproduced: Optional[bool]
    weight_distance: Optional[float]
    max_module_distance: Optional[float]
    capability_gap: Optional[float]
    reference_gap: Optional[float]
    controls_drift: Optional[float]
    reason: str

    def to_dict(self) -> dict:
        return {**asdict(self), "tolerance": dict(TOLERANCE)}


def judge(distance: Optional[dict], reference_scores: Optional[Sequence[float]],
          control_scores: Sequence[Sequence[float]], base: Sequence[float], tuned: Sequence[float]) -> Reproduction:
    """The reproduction verdict from the reference retrain's weight distance (None: no reference was run), its eval
    scores and the controls' (see the module docstring). `tuned`: the user's fine-tune's per-item scores."""
    b, t = float(np.mean(base)), float(np.mean(tuned))
    change = b - t
    frac = (lambda s: (float(np.mean(s)) - t) / change) if abs(change) > 1e-12 else (lambda s: None)
    wd = distance.get("relative") if distance else None
    gap = float(np.mean(reference_scores)) - t if reference_scores is not None else None
    ref_frac = frac(reference_scores) if reference_scores is not None else None
    drifts = [frac(s) for s in control_scores]
    drift = float(np.mean([abs(d) for d in drifts])) if drifts and None not in drifts else None
    tol = TOLERANCE
    fails, checked = [], []
    if distance is not None:
        if wd is None:
            fails.append(distance.get("why", "the reference retrain cannot be compared with your adapter"))
        else:
            checked.append(f"LoRA weights {wd:.1%} from your adapter's")
            if wd > tol["max_weight_distance"]:
                fails.append(f"the reference retrain (nothing dropped) is {wd:.1%} away from your adapter's LoRA "
                             f"weights (tolerance {tol['max_weight_distance']:.0%})")
    if ref_frac is not None:
        checked.append(f"capability {abs(ref_frac):.0%} of the change from your fine-tune's")
        if abs(ref_frac) > tol["max_reference_gap"]:
            fails.append(f"the reference retrain's capability differs from your fine-tune's by {abs(ref_frac):.0%} "
                         f"of the change (tolerance {tol['max_reference_gap']:.0%})")
    if drift is not None:
        checked.append(f"random-row retrains on average {drift:.0%} of the change away from it")
        if drift > tol["max_controls_drift"]:
            fails.append(f"retrains without random rows moved the capability by {drift:.0%} of the change on average "
                         f"(tolerance {tol['max_controls_drift']:.0%})")
    if fails:
        return Reproduction(False, wd, distance.get("max_module") if distance else None, gap, ref_frac, drift,
                            "; ".join(fails))
    if not checked:
        return Reproduction(None, None, None, None, None, None,
                            "no reference retrain and no random control was run, so whether the retrains reproduce "
                            "your fine-tune is unknown")
    lead = "the reference retrain reproduces your fine-tune" if distance is not None else \
        "no reference retrain was run; the random controls stay near your fine-tune"
    return Reproduction(True, wd, distance.get("max_module") if distance else None, gap, ref_frac, drift,
                        f"{lead} ({', '.join(checked)})")
