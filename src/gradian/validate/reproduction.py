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


def lora_updates(tensors: dict) -> dict:
    """{module: dW = B @ A in float64} for every LoRA pair of a saved adapter; other saved tensors (modules_to_save,
    trainable tokens) as they are, under their own names."""
    out, seen = {}, set()
    for k, t in tensors.items():
        if ".lora_A." in k:
            kb = k.replace(".lora_A.", ".lora_B.")
            if kb in tensors:
                a, b = t.double(), tensors[kb].double()
                out[k.replace(".lora_A.weight", "").replace(".lora_A.", ".")] = b.reshape(b.shape[0], -1) @ \
                    a.reshape(a.shape[0], -1)
                seen.update((k, kb))
    for k, t in tensors.items():
        if k not in seen:
            out[k] = t.double()
    return out


def weight_distance(reference: Path, user: Path) -> dict:
    """{"relative", "max_module", "module", "modules"} of the reference retrain's LoRA updates against the user's
    (see the module docstring); {"relative": None, "why": ...} when they cannot be compared."""
    from safetensors.torch import load_file

    fa, fb = Path(reference) / "adapter_model.safetensors", Path(user) / "adapter_model.safetensors"
    if not (fa.exists() and fb.exists()):
        return {"relative": None, "why": f"{fb if not fb.exists() else fa} is missing"}
    ua, ub = lora_updates(load_file(str(fa))), lora_updates(load_file(str(fb)))
    if ua.keys() != ub.keys() or any(ua[k].shape != ub[k].shape for k in ua):
        return {"relative": None, "why": "the reference retrain's adapter has other LoRA modules or shapes than yours"}
    num = den = 0.0
    worst, worst_name = 0.0, None
    for k in ub:
        d, n = float((ua[k] - ub[k]).norm() ** 2), float(ub[k].norm() ** 2)
        num, den = num + d, den + n
        r = (d ** 0.5) / (n ** 0.5) if n > 0 else (0.0 if d == 0 else float("inf"))
        if r > worst or worst_name is None:
            worst, worst_name = r, k
    rel = (num ** 0.5) / (den ** 0.5) if den > 0 else (0.0 if num == 0 else float("inf"))
    return {"relative": rel, "max_module": worst, "module": worst_name, "modules": len(ub)}


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
        checked.append(f"random-row retrains {drift:.0%} of the change from it on average")
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
