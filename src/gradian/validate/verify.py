"""`gradian verify`: prove an attribution by retraining without the accused rows.

What it does, in order:

1. Reads ``OUT/report.json`` (refused when missing or when its verdict is not ``attributed``) and the recipe
   ``gradian_recipe.json`` beside ``model.adapter`` (refused when missing: an adapter trained elsewhere. The message
   lists the fields of a recipe the user can write by hand, see :data:`RECIPE_REQUIRED`).
2. Retrains from the same base with the same recipe (seed, hyperparameters, data order) three ways:
   *reference* (nothing dropped: proves the recipe reproduces the fine-tune, bit for bit on CPU),
   *accused* (minus the top-K rows of the ranking) and N *controls* (minus K random rows, never an accused one,
   drawn with ``numpy.random.default_rng([seed, 6, i])``).
3. Re-measures the capability of each retrain on the same eval items with the same generation settings, and
   reports its value, the share of the fine-tune's change it reverted and paired bootstrap intervals.

Removal is by zero-weighting in place (see :func:`gradian.training.loop.train_adapter`): the data order is a function of
(n, epochs, batch size, seed) only, so every remaining row keeps its batch and its step; a dropped row contributes
nothing to its batch's loss, whose token-weighted mean is over the remaining rows' supervised tokens. A batch left
with no rows skips its optimizer step. Nothing else changes between the original fine-tune and a retrain.

Definitions
-----------
``reverted_fraction = (cap_retrained - cap_tuned) / (cap_base - cap_tuned)``: 1 means dropping the rows undid the
whole change, 0 means nothing moved, negative means the retrain moved further away. ``tuned`` is the original
fine-tune's per-item scores from report.json; when the reference retrain does not reproduce the adapter bit for
bit (another trainer's recipe, a non-deterministic GPU kernel) the reference retrain is the ``tuned`` side instead,
so every comparison is retrain-vs-retrain. ``difference`` / ``difference_ci`` is the paired bootstrap interval of
``cap_retrained - cap_tuned`` over the eval items; ``ci`` is the paired bootstrap interval of the reverted fraction
itself (numerator and denominator resampled together, see :func:`reverted_interval`).

Default K: the accused set of report.json (``accused.count``: the rows whose scores stand out from the null, see
`attribution.accused`); when the report has none (written before that rule, or no row stood out), the number of
planted rows when ``OUT/truth.json`` (or the report's ``truth``) says so; otherwise
``min(attribution.top_k, max(1, ceil(5% of the rows)))``: a claim about a handful of rows, not a sizeable share of
the data (dropping a large share would revert any change and prove nothing).

Verdict rule (:func:`verdict_of`): *confirmed* when the retrains reproduce the user's fine-tune (the reference
retrain's LoRA weights and capability, and the random controls' capability, within `reproduction.TOLERANCE` of the
user's adapter: see `validate.reproduction`) and the accused retrain reverts at least 50% of the change, at least
25 percentage points more than the mean of the random controls, with its difference interval excluding zero on the
reverting side (:func:`decide`). *not_reproduced* when a reproduction measure is out of tolerance (nothing is
confirmed on retrains that do not reproduce the run); *not_confirmed* when the removal rule fails; *inconclusive*
when the retrains do not show a capability change or nothing measured whether they reproduce the run (no reference
retrain and no control). `confirmed` is True, False (not_reproduced, not_confirmed) or None (inconclusive).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..capability.metrics import paired_bootstrap
from ..config import Config
from ..errors import VerifyError
from .. import distributed as dist_
from ..io import atomic_write_text
from ..report.read import REPORT_FILE, load_report
from ..report.schema import Report
from ..training.backends import backend_for
from ..training.recipe import Recipe
from ..verdict import Verdict
from .reproduction import Reproduction, judge, weight_distance
from .retrain import (RetrainJob, RetrainSettings, Retrained, adapters_equal, measure_adapter, removal_text,
                      retrain_many, retrain_recipe)

SCHEMA = "gradian.verify/1"
RULE = {"min_reverted": 0.5, "min_margin_over_controls": 0.25, "interval_excludes_zero": True}


# ------------------------------------------------------------------------------------------ inputs


def read_report(cfg: Config, verb: str = "verify") -> Report:
    """OUT/report.json, typed (`report.read.load_report`), when it attributed rows; VerifyError saying why not."""
    path = cfg.output_dir / REPORT_FILE
    if not path.exists():
        raise VerifyError(f"{path}: no report to {verb}; run `gradian attribute CONFIG` first")
    report = load_report(cfg.output_dir)
    verdict = report.verdict
    if verdict is not Verdict.attributed:
        why = {Verdict.declined: "the fine-tune did not move the capability measurably, so no rows were accused",
               Verdict.smoke_test: "there is no eval set, so the ranking is a smoke test, not an accusation"}[verdict]
        raise VerifyError(f"{path}: verdict is '{verdict}', not 'attributed': {why}; there is nothing to {verb}")
    if not report.ranking:
        raise VerifyError(f"{path}: the report ranks no training rows; rerun `gradian attribute CONFIG`")
    return report


def default_top_k(cfg: Config, report: Report, n_rows: int) -> tuple[int, str]:
    if report.accused is not None and report.accused.count > 0:
        return report.accused.count, "the accused set (report.json accused: rows that stand out from the null)"
    truth = _truth(cfg, report)
    if truth and truth.get("planted"):
        return len(truth["planted"]), "the number of planted rows (truth.json)"
    k = min(cfg.attribution.top_k, max(1, math.ceil(0.05 * n_rows)))
    return k, "min(attribution.top_k, 5% of the rows)"


def _truth(cfg: Config, report: Report) -> Optional[dict]:
    f = cfg.output_dir / "truth.json"
    if f.exists():
        try:
            return json.loads(f.read_text())
        except ValueError:
            return None
    return report.truth.model_dump(mode="json", exclude_unset=True) if report.truth is not None else None


def accused_positions(report: Report, scores: Optional[np.ndarray], k: int) -> list[int]:
    """The accused rows first (report.json accused.positions: the accusation has its own statistic, so they need
    not be the top of the ranking), then the rows in the order the report shows them (exact re-ranking included),
    then by scores.npy; the first k."""
    acc = list(report.accused.positions) if report.accused is not None else []
    out = list(dict.fromkeys(acc + [r.position for r in report.ranking]))[:k]
    if len(out) < k and scores is not None:
        from ..attribution.scoring import rank

        seen = set(out)
        out += [int(p) for p in rank(scores) if int(p) not in seen][: k - len(out)]
    return out


def control_sets(n: int, k: int, accused: Sequence[int], n_controls: int, seed: int) -> list[list[int]]:
    """n_controls seeded draws of k rows from those not accused."""
    pool = np.array(sorted(set(range(n)) - set(int(a) for a in accused)), dtype=np.int64)
    if pool.size < k:
        raise VerifyError(f"only {pool.size} rows are not accused; cannot draw a random control of {k}")
    return [sorted(np.random.default_rng([seed, 6, i]).choice(pool, size=k, replace=False).tolist())
            for i in range(n_controls)]


# ------------------------------------------------------------------------------------------ arithmetic


def reverted_interval(base: Sequence[float], tuned: Sequence[float], retrained: Sequence[float], *, samples: int,
                      confidence: float, seed: int) -> list[Optional[float]]:
    """Paired percentile bootstrap of the ratio (mean(retrained) - mean(tuned)) / (mean(base) - mean(tuned)).

    Items are resampled together for numerator and denominator, so a retrain that restores every changed item has
    the interval [1, 1]. Resamples in which base and tuned do not differ (no change to revert) are left out."""
    b, t, r = (np.asarray(x, dtype=np.float64) for x in (base, tuned, retrained))
    n = b.size
    if n == 0:
        return [None, None]
    rng = np.random.default_rng(seed)
    ratios = []
    step = max(1, 2_000_000 // n)
    for s0 in range(0, samples, step):
        idx = rng.integers(0, n, size=(min(step, samples - s0), n))
        den = (b[idx] - t[idx]).mean(axis=1)
        num = (r[idx] - t[idx]).mean(axis=1)
        ok = np.abs(den) > 1e-12
        ratios.append(num[ok] / den[ok])
    allr = np.concatenate(ratios) if ratios else np.array([])
    if allr.size < max(10, samples // 10):
        return [None, None]
    alpha = 1.0 - confidence
    lo, hi = np.quantile(allr, [alpha / 2, 1 - alpha / 2])
    return [float(lo), float(hi)]


def compare(base: Sequence[float], tuned: Sequence[float], retrained: Sequence[float], *, samples: int,
            confidence: float, seed: int) -> dict:
    """Capability of a retrain, the share of the change it reverted and its paired intervals."""
    b, t, r = (float(np.mean(x)) for x in (base, tuned, retrained))
    diff, lo, hi = paired_bootstrap(tuned, retrained, samples=samples, confidence=confidence, seed=seed)
    den = b - t
    if abs(den) < 1e-12:
        frac, ci = None, [None, None]
    else:
        frac = diff / den
        ci = reverted_interval(base, tuned, retrained, samples=samples, confidence=confidence, seed=seed)
    return {"capability": r, "reverted_fraction": frac, "ci": ci, "difference": diff, "difference_ci": [lo, hi]}


def decide(accused: dict, controls: list[dict], base: float, tuned: float) -> tuple[bool | None, str]:
    """The verdict rule: see the module docstring. Returns (confirmed or None when inconclusive, reason)."""
    if abs(base - tuned) < 1e-12:
        return None, "the reference retrain does not reproduce a capability change, so nothing can be reverted"
    fr = accused["reverted_fraction"]
    cm = float(np.mean([c["reverted_fraction"] for c in controls])) if controls else 0.0
    lo, hi = accused["difference_ci"]
    toward_base = np.sign(base - tuned)
    excludes_zero = (lo > 0) if toward_base > 0 else (hi < 0)
    ok = fr >= RULE["min_reverted"] and fr >= cm + RULE["min_margin_over_controls"] and excludes_zero
    if ok:
        return True, "reverted >= 50%, >= controls + 25 points, interval excludes zero"
    why = []
    if fr < RULE["min_reverted"]:
        why.append(f"reverted {fr:.0%} < 50%")
    if fr < cm + RULE["min_margin_over_controls"]:
        why.append(f"not 25 points above the random controls ({cm:.0%})")
    if not excludes_zero:
        why.append("the interval of the difference includes zero")
    return False, "; ".join(why)


def verdict_of(removal: tuple[bool | None, str], reproduction: Reproduction) -> tuple[str, bool | None, str]:
    """(verdict, confirmed, reason): the removal rule (`decide`) stands only on retrains that reproduce the run."""
    confirmed, reason = removal
    if confirmed is None:
        return "inconclusive", None, reason
    if reproduction.reproduced is False:
        return "not_reproduced", False, reproduction.reason
    if reproduction.reproduced is None:
        return "inconclusive", None, reproduction.reason
    return ("confirmed" if confirmed else "not_confirmed"), confirmed, reason


def dropped_words(k: int, n_accused: int) -> str:
    """What the accused retrain dropped, in words that stay true when fewer rows were accused than dropped (--top-k,
    or a report that accuses nobody: then the claim verified is the top of the ranking)."""
    if n_accused >= k:
        return f"the {k} accused rows" if n_accused == k else f"the top {k} accused rows"
    if n_accused == 0:
        return f"the top {k} rows of the ranking (none accused)"
    return f"the {n_accused} accused rows and the next {k - n_accused} of the ranking"


def statement(res: dict) -> str:
    m, k = res["metric"], res["top_k"]
    a = res["accused"]
    if res["confirmed"] is None and a["reverted_fraction"] is None:
        return (f"Inconclusive: {res['reason']}. Retraining with the recipe gave {m} {res['tuned']:.2f} "
                f"vs base {res['base']:.2f}.")
    ctl = (f"dropping {k} random rows reverted {res['control_mean_reverted']:.0%} on average "
           f"({len(res['controls'])} control{'s' if len(res['controls']) != 1 else ''})") if res["controls"] else "no random control was run"
    lo, hi = a["ci"]
    interval = (f" ({int(res['confidence'] * 100)}% interval {lo:.0%} to {hi:.0%})" if lo is not None else "")
    core = (f"retraining without {res.get('dropped') or dropped_words(k, k)} moved {m} from {res['tuned']:.2f} to {a['capability']:.2f} "
            f"(base {res['base']:.2f}): {a['reverted_fraction']:.0%} of the fine-tune's change reverted{interval}; "
            f"{ctl}")
    if res["verdict"] == "not_reproduced":
        return (f"Not reproduced: {res['reason']}, so the retrains are no evidence about the rows they drop and "
                f"nothing is confirmed. (For the record, {core}.)")
    if res["verdict"] == "inconclusive":
        return f"Inconclusive: {res['reason']}. For the record, {core}."
    if res["confirmed"]:
        return f"Confirmed: {core}; {res['reproduction']['reason']}. These rows caused the change."
    return f"Not confirmed: {core} ({res['reason']})."


# ------------------------------------------------------------------------------------------ the verb


@dataclass(frozen=True)
class VerifyInputs:
    """What verify reads and decides before it retrains: the report, the recipe, the session (data, no model),
    the eval items' base and fine-tuned scores, K and why, the accused rows and the random controls."""

    report: Report
    recipe: Optional[Recipe]
    recipe_path: str
    user_adapter: Path
    session: Any
    base_scores: list[float]
    tuned_scores: list[float]
    top_k: int
    top_k_rule: str
    accused: list[int]
    control_sets: list[list[int]]

    @property
    def n_rows(self) -> int:
        return len(self.session.examples)


@dataclass(frozen=True)
class ReferenceCheck:
    """The reference retrain (nothing dropped) against the user's adapter (`distance`: its LoRA weights',
    `reproduction.weight_distance`), and the scores every retrain is compared with: the original fine-tune's, or the
    reference retrain's when it does not reproduce the adapter bit for bit."""

    summary: Optional[dict]
    tuned_side: list[float]
    distance: Optional[dict] = None
    scores: Optional[list[float]] = None


def verify_inputs(cfg: Config, top_k: Optional[int], controls: int) -> VerifyInputs:
    """Step 1: the report, the recipe and the rows to drop, refused with a VerifyError that says what to do."""
    from ..setup.session import open_session

    report = read_report(cfg, "verify")
    recipe, recipe_path = retrain_recipe(cfg)
    user_adapter = Path(cfg.local_or_hub(cfg.model.adapter, "model.adapter"))
    if not cfg.data.eval:
        raise VerifyError("data.eval is not set: verify re-measures the capability on the eval set")
    ctx = open_session(cfg, load_model_=False)
    n = len(ctx.examples)
    items = report.capability.items if report.capability is not None else []
    if len(items) != len(ctx.eval_items):
        raise VerifyError(f"{cfg.output_dir / REPORT_FILE}: it measured {len(items)} eval items but data.eval has "
                          f"{len(ctx.eval_items)}; rerun `gradian attribute CONFIG`")
    if any(it.base_score is None or it.tuned_score is None for it in items):
        raise VerifyError(f"{cfg.output_dir / REPORT_FILE}: capability.items have no base_score/tuned_score (a report "
                          "of an older version); rerun `gradian attribute CONFIG`")
    scores_path = cfg.output_dir / "scores.npy"
    scores = np.load(scores_path, allow_pickle=False) if scores_path.exists() else None
    k, k_rule = default_top_k(cfg, report, n) if top_k is None else (int(top_k), "--top-k")
    if k < 1 or k >= n:
        raise VerifyError(f"--top-k {k}: must be between 1 and {n - 1} (the training set has {n} rows)")
    accused = accused_positions(report, scores, k)
    if len(accused) < k:
        raise VerifyError(f"the report ranks only {len(accused)} rows and OUT/scores.npy is missing; use --top-k "
                          f"{len(accused)} or rerun attribute with a larger attribution.top_k")
    return VerifyInputs(report, recipe, str(recipe_path), user_adapter, ctx, [float(it.base_score) for it in items],
                        [float(it.tuned_score) for it in items], k, k_rule, accused,
                        control_sets(n, k, accused, controls, cfg.seed))


def verify_jobs(inputs: VerifyInputs, work: Path, reference: bool) -> list[RetrainJob]:
    """Step 2: the retrains, in order: the reference (nothing dropped), the accused, then each random control."""
    named = ([("reference", [])] if reference else []) + [("accused", inputs.accused)] + \
        [(f"control-{i + 1}", s) for i, s in enumerate(inputs.control_sets)]
    return [RetrainJob(name, tuple(excl), work / name) for name, excl in named]


def _retrain_measured(cfg: Config, inputs: VerifyInputs, jobs: list[RetrainJob], log_path: Optional[Path],
                      keep_adapters: bool, say) -> dict[str, Retrained]:
    """Step 3: every retrain and its eval scores and answers (`measure_adapter`); the retrained adapters removed
    when a retrain fails, unless they are kept."""
    k = inputs.top_k
    dropped = dropped_words(k, inputs.report.accused.count if inputs.report.accused is not None else 0)

    def announce(j: int, job: RetrainJob) -> None:
        what = "nothing dropped" if not job.exclude else (f"minus {dropped}" if job.name == "accused"
                                                          else f"minus {k} random rows")
        say(f"[bold]retrain {j + 1}/{len(jobs)}[/] {job.name}: {what}")

    settings = RetrainSettings(cfg, inputs.recipe, inputs.user_adapter, log_path=log_path)
    try:
        done = retrain_many(settings, jobs, lambda job, path: measure_adapter(cfg, path, inputs.session),
                            before=announce)
    except BaseException:
        if not keep_adapters:
            _remove_retrains(jobs[0].out_dir.parent, [job.name for job in jobs])
        raise
    return {r.job.name: r for r in done}


def reference_check(inputs: VerifyInputs, measured: dict[str, Retrained]) -> ReferenceCheck:
    """Step 4: did the reference retrain reproduce the adapter? If not, retrains are compared with it instead."""
    r = measured.get("reference")
    if r is None:
        return ReferenceCheck(None, inputs.tuned_scores)
    scores = r.measured[0]
    same = adapters_equal(r.path, inputs.user_adapter)
    distance = weight_distance(r.path, inputs.user_adapter)
    summary = {"reproduced_bit_for_bit": same, "capability": float(np.mean(scores)),
               "matches_original_items": scores == inputs.tuned_scores, "used_as_tuned": not same,
               "weight_distance": distance.get("relative"), "max_module_distance": distance.get("max_module"),
               "max_module": distance.get("module")}
    return ReferenceCheck(summary, inputs.tuned_scores if same else scores, distance, scores)


def verify_result(cfg: Config, inputs: VerifyInputs, measured: dict[str, Retrained], ref: ReferenceCheck, *,
                  log_path: Optional[Path], work: Path, keep_adapters: bool, started: float) -> dict:
    """Step 5: verify.json: each retrain compared with the fine-tune, the verdict and its statement."""
    e = cfg.evaluation
    base_m, tuned_m = float(np.mean(inputs.base_scores)), float(np.mean(ref.tuned_side))

    def cmp(name: str) -> dict:
        r = measured[name]
        scores, generated = r.measured
        d = compare(inputs.base_scores, ref.tuned_side, scores, samples=e.bootstrap_samples, confidence=e.confidence,
                    seed=cfg.seed)
        d.update({"positions": list(r.job.exclude), "item_scores": scores, "generated": generated,
                  "train_seconds": round(r.train_seconds, 2), "eval_seconds": round(r.measure_seconds, 2)})
        return d

    acc = cmp("accused")
    ctls = [cmp(f"control-{i + 1}") for i in range(len(inputs.control_sets))]
    ctl_fr = [c["reverted_fraction"] for c in ctls if c["reverted_fraction"] is not None]
    if acc["reverted_fraction"] is None:
        removal = None, "the reference retrain does not reproduce a capability change, so nothing can be reverted"
    else:
        removal = decide(acc, ctls, base_m, tuned_m)
    reproduction = judge(ref.distance if ref.summary is not None else None, ref.scores,
                         [c["item_scores"] for c in ctls], inputs.base_scores, inputs.tuned_scores)
    verdict, confirmed, reason = verdict_of(removal, reproduction)
    res = {
        "schema": SCHEMA, "metric": inputs.report.capability.metric, "n_items": len(inputs.base_scores),
        "n_rows": inputs.n_rows, "top_k": inputs.top_k, "top_k_rule": inputs.top_k_rule, "base": base_m,
        "dropped": dropped_words(inputs.top_k, inputs.report.accused.count if inputs.report.accused is not None
                                 else 0),
        "tuned": tuned_m, "original_tuned": float(np.mean(inputs.tuned_scores)), "confidence": e.confidence,
        "accused": acc, "controls": ctls, "control_mean_reverted": float(np.mean(ctl_fr)) if ctl_fr else None,
        "reference": ref.summary, "reproduction": reproduction.to_dict(), "verdict": verdict, "confirmed": confirmed,
        "reason": reason, "rule": dict(RULE), "recipe": inputs.recipe_path,
        "recipe_origin": ((inputs.recipe.origin or "gradian_recipe.json") if inputs.recipe is not None
                          else "train.command"),
        "backend": backend_for(cfg, inputs.recipe),
        "removal": removal_text(cfg, inputs.recipe),
        **({"train_log": str(log_path)} if log_path is not None else {}),
        "adapters": str(work) if keep_adapters else None,
        "timings": {**{n: round(r.train_seconds + r.measure_seconds, 2) for n, r in measured.items()},
                    "total": round(time.time() - started, 2)},
    }
    truth = _truth(cfg, inputs.report)
    if truth and truth.get("planted"):
        res["accused"]["planted_among"] = len(set(int(p) for p in truth["planted"]) & set(inputs.accused))
    res["statement"] = statement(res)
    return res


def run_verify(cfg: Config, *, top_k: Optional[int] = None, controls: int = 3, keep_adapters: bool = False,
               reference: bool = True, console=None) -> dict:
    """Retrain without the accused and without random rows; writes OUT/verify.json and OUT/report.html."""
    from ..runtime import configure_threads, seed_everything

    t_all = time.time()
    configure_threads(cfg.model.threads)
    inputs = verify_inputs(cfg, top_k, controls)
    seed_everything(cfg.seed)
    work = cfg.output_dir / "verify"
    work.mkdir(parents=True, exist_ok=True)
    log_path = cfg.output_dir / "verify.train.log" if cfg.train.command else None
    if log_path is not None:
        log_path.unlink(missing_ok=True)  # this run's log only
    jobs = verify_jobs(inputs, work, reference)
    say = console.print if console is not None else (lambda *a, **kw: None)
    measured = _retrain_measured(cfg, inputs, jobs, log_path, keep_adapters, say)
    res = verify_result(cfg, inputs, measured, reference_check(inputs, measured), log_path=log_path, work=work,
                        keep_adapters=keep_adapters, started=t_all)
    dist_.barrier()  # every rank done with the retrained adapters
    if dist_.current().is_main:
        if not keep_adapters:
            _remove_retrains(work, [job.name for job in jobs])
        atomic_write_text(cfg.output_dir / "verify.json", json.dumps(res, indent=2))
        rewrite_html(cfg.output_dir)
    dist_.barrier()
    return res


def _remove_retrains(work: Path, names: Sequence[str]) -> None:
    """Delete the retrained adapters verify wrote (only those), then OUT/verify itself when it is empty."""
    for name in names:
        shutil.rmtree(work / name, ignore_errors=True)
    try:
        work.rmdir()
    except OSError:
        pass


def rewrite_html(run_dir: Path) -> Optional[Path]:
    from ..report.html import write_run_html

    return write_run_html(run_dir)
