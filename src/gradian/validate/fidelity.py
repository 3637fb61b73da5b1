"""`gradian fidelity`: do the attribution scores predict what retraining actually does?

Two measurements, both on deterministic retrains with the adapter's recipe (rows removed by zero-weighting in
place, so the only difference between two retrains is the removed rows; see :mod:`gradian.validate.verify`):

* **Leave-one-out (LOO)** on the top ``--loo`` rows by score, the bottom ``--loo`` and ``--loo`` random others
  (seeded). Predicted change of a row = its attribution score (the per-item scores averaged over the failing
  items, as in report.json). Actual change = the *query measurement* of the retrain without that row vs the
  reference retrain (nothing removed), see below. Pearson and Spearman of predicted vs actual.
* **LDS** (linear datamodeling score): ``--subsets`` random subsets of ``--frac`` (5%) of the rows are removed;
  for each failing item the predicted change is the sum of the removed rows' per-item scores and the actual change
  its query measurement; the Spearman over subsets is averaged over the items.

The query measurement, per failing item q, is the query loss the attribution differentiates
(`query.query_losses`): the contrastive ``L_q = loss(expected answer) - loss(the fine-tune's wrong answer)`` (summed
token losses; ``loss(expected)`` for classic queries; minus the margin at the decisive token for margin queries). Scores are ``-<q_hat, g>`` with unit query gradients, so the actual change that matches a score in
sign and scale is ``a_q = s * (L_q(reference) - L_q(retrain)) / |grad L_q|``: positive when removing the rows lowered
the failure's loss (they were harmful), with ``s = -1`` when the report attributes an improvement (its scores rank the
rows that helped). A row's LOO actual change is the mean of ``a_q`` over the items, like its score.

Preconditioners: scores are recomputed with `attribution.stage.scores_for` (the per-item inner products, without the
best-window ranking of long rows) for ``attribution.preconditioner`` or each one given with ``--preconditioner``;
the retrains do not depend on it, so several are compared on the same retrains. (With a preconditioner, items are
still weighted by 1 / |grad L_q| in the LOO mean; LDS is per item, so no weighting enters it.)

Reading LDS: with small subsets (5% of the rows) and failures that each have one cause, few subsets remove an
item's cause and the others differ only by the small, deterministic but chaotic effect of removing unrelated rows,
which no first-order score predicts. When OUT/truth.json exists, ``lds.truth_oracle`` is the LDS of a predictor
that knows which planted row causes which item: the ceiling of the design. ``--frac 0.5`` (TRAK's usual alpha)
removes every item's cause in about half of the subsets.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..attribution.queries import QueryItem, query_losses as _query_losses
from ..attribution.scoring import direction_sign, rank
from ..config import Config
from ..errors import VerifyError
from .. import distributed as dist_
from ..io import atomic_write_text
from ..report.read import queries_from_report
from ..report.schema import Report
from .retrain import RetrainJob, RetrainSettings, adapters_equal, retrain_many, retrain_recipe
from .verify import read_report

SCHEMA = "gradian.fidelity/1"
OPTIMIZER_METHOD = "adamw"  # the optimizer-aware scores' entry among the preconditioners' (by_preconditioner)


def correlations(x: Sequence[float], y: Sequence[float]) -> dict:
    from scipy.stats import pearsonr, spearmanr

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return {"pearson": None, "spearman": None, "n": int(x.size)}
    return {"pearson": float(pearsonr(x, y)[0]), "spearman": float(spearmanr(x, y)[0]), "n": int(x.size)}


def report_queries(report: Report) -> tuple[list[QueryItem], str]:
    """The failing items' queries exactly as `attribute` built them (`report.read.queries_from_report`: every
    field, the own-words target, contrast and span included), and the report's direction."""
    items = queries_from_report(report)
    if not items:
        raise VerifyError("report.json lists no failing items in query.items; rerun `gradian attribute CONFIG`")
    return items, report.query.direction or "regression"


def query_losses(model, s, qitems) -> np.ndarray:
    """[Q] query loss of each failing item under `model`: the function `queries.query_vectors` differentiates
    (contrastive, classic or margin), through `queries.query_losses`."""
    return _query_losses(model, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=s.cfg.grads.max_seq_length,
                   batch_size=s.cfg.grads.batch_size)


def scores_with(s, qitems, direction: str, **overrides) -> np.ndarray:
    """Per-item scores [Q, N] exactly as `attribute` computes them (`attribution.stage.scores_for`: the same
    adapter states, row source and windows), with the config's settings but `overrides` (another preconditioner)."""
    return np.asarray(_ranking(s, qitems, direction, **overrides).totals, dtype=np.float64)


def _ranking(s, qitems, direction: str, **overrides):
    from ..pipeline import score_stage

    return score_stage(s, qitems, direction, **overrides)


def loo_rows(agg: np.ndarray, k: int, seed: int) -> list[tuple[int, str]]:
    """Top k, bottom k and k random others (seeded), without repeats."""
    order = rank(agg.astype(np.float64))
    top = [int(p) for p in order[:k]]
    bottom = [int(p) for p in order[::-1] if int(p) not in top][:k]
    rest = np.array(sorted(set(range(agg.size)) - set(top) - set(bottom)), dtype=np.int64)
    rnd = sorted(np.random.default_rng([seed, 8]).choice(rest, size=min(k, rest.size), replace=False).tolist())
    return [(p, "top") for p in top] + [(p, "bottom") for p in bottom] + [(int(p), "random") for p in rnd]


def lds_subsets(n: int, m: int, count: int, seed: int) -> list[list[int]]:
    return [sorted(np.random.default_rng([seed, 7, j]).choice(n, size=m, replace=False).tolist()) for j in range(count)]


def lds(per_item: np.ndarray, subsets: list[list[int]], actual: np.ndarray) -> dict:
    """Spearman over subsets of predicted (sum of removed rows' scores) vs actual, per item, averaged."""
    from scipy.stats import spearmanr

    pred = np.stack([per_item[:, S].sum(axis=1) for S in subsets], axis=1)  # [Q, J]
    per_q = []
    for q in range(per_item.shape[0]):
        a, p = actual[:, q], pred[q]
        per_q.append(None if (np.all(a == a[0]) or np.all(p == p[0])) else float(spearmanr(p, a)[0]))
    vals = [v for v in per_q if v is not None]
    agg = correlations(pred.mean(axis=0), actual.mean(axis=1))
    return {"lds": float(np.mean(vals)) if vals else None, "per_item": per_q, "aggregate_spearman": agg["spearman"]}


class _removed_after:
    """Delete the scratch retrain directory however the loop ends."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        shutil.rmtree(self.path, ignore_errors=True)
        return False


class _restore_hf_bars:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.enabled:
            from transformers.utils import logging as hf_logging

            hf_logging.enable_progress_bar()
        return False


def truth_oracle(cfg: Config, items: list[int], subsets: list[list[int]], actual: np.ndarray) -> Optional[float]:
    """LDS of a predictor that knows the ground truth (demo scenarios): for an item whose planted row is known
    (truth.json planted_facts[].eval_indices or .eval_index), whether that row was removed; for other items, how many planted rows
    were. A ceiling for scores on this design: with small subsets few of them remove an item's cause, and the
    rest vary only by the (deterministic but chaotic) effect of removing unrelated rows."""
    from scipy.stats import spearmanr

    f = cfg.output_dir / "truth.json"
    if not f.exists():
        return None
    try:
        truth = json.loads(f.read_text())
    except ValueError:
        return None
    planted = set(int(p) for p in truth.get("planted") or [])
    if not planted:
        return None
    own = {}
    for pf in truth.get("planted_facts") or []:
        if "position" in pf:
            for i in pf.get("eval_indices") or ([pf["eval_index"]] if "eval_index" in pf else []):
                own[int(i)] = int(pf["position"])
    vals = []
    for q, it in enumerate(items):
        pred = np.array([float(own[it] in S) if it in own else float(len(planted & set(S))) for S in subsets])
        a = actual[:, q]
        if not (np.all(pred == pred[0]) or np.all(a == a[0])):
            vals.append(float(spearmanr(pred, a)[0]))
    return float(np.mean(vals)) if vals else None


@dataclass(frozen=True)
class Predictions:
    """What the scores predict, before any retrain: per-item scores [Q, N] by method (each preconditioner, and the
    optimizer-aware scores when recorded), the query gradients' norms [Q] and the query losses under the user's
    adapter [Q]."""

    per_item: dict[str, np.ndarray]
    qnorm: np.ndarray
    user_losses: np.ndarray

    def aggregate(self) -> dict[str, np.ndarray]:
        """Each method's row scores [N]: the per-item scores averaged over the items, as report.json ranks them."""
        return {p: v.mean(axis=0) for p, v in self.per_item.items()}


@dataclass(frozen=True)
class FidelityPlan:
    """The retrains: the LOO rows (position, group), the LDS subsets and their size, and every job in order (the
    reference first)."""

    rows: list[tuple[int, str]]
    subsets: list[list[int]]
    subset_size: int
    jobs: list[RetrainJob]


@dataclass(frozen=True)
class RetrainLosses:
    """The query losses [Q] of every retrain by job name, whether the reference retrain reproduced the adapter bit
    for bit, and the seconds spent training and measuring (summed over retrains)."""

    losses: dict[str, np.ndarray]
    reference_equal: Optional[bool]
    train_seconds: float
    measure_seconds: float


def checked_preconditioners(cfg: Config, preconditioners: Optional[list[str]]) -> list[str]:
    """The preconditioners to compare (the config's when none is given); VerifyError naming an unknown one."""
    from ..config import PreconditionerKind

    precs = preconditioners or [cfg.attribution.preconditioner]
    known = [k.value for k in PreconditionerKind]
    for p in precs:
        if p not in known:
            raise VerifyError(f"--preconditioner {p}: unknown; one of {', '.join(known)}")
    return precs


def predictions(s, qitems: list[QueryItem], direction: str, precs: list[str]) -> Predictions:
    """Step 1: the scores of every method on the session's index, the query gradients' norms and the query losses
    under the user's adapter; the session's model is freed after (each retrain is loaded on its own)."""
    from ..model_side import gradients_of, optimizer_scores
    from ..pipeline import state_view

    cfg = s.cfg
    ranked = {p: _ranking(s, qitems, direction, preconditioner=p) for p in precs}
    per_item = {p: np.asarray(v.totals, dtype=np.float64) for p, v in ranked.items()}
    if cfg.attribution.optimizer != "adamw":
        # the optimizer-aware scores beside the preconditioners', when the adapter's trajectory was recorded
        P = optimizer_scores(s, qitems, direction)
        if P is not None:
            per_item[OPTIMIZER_METHOD] = P
    # the query gradients at the adapter state the primary scores came from (the earliest checkpoint by default):
    # the unit queries the scores were taken against are these over their norms
    with state_view(s, ranked[precs[0]].state_path) as view:
        qv = gradients_of(view).query_vectors(qitems, exact=True)
    qnorm = np.maximum(np.linalg.norm(qv.astype(np.float64), axis=1), 1e-30)
    user_losses = query_losses(s.model, s, qitems)
    s.model = None  # free it: each retrain is loaded on its own
    return Predictions(per_item, qnorm, user_losses)


def fidelity_plan(primary_scores: np.ndarray, n: int, work: Path, *, loo: int, subsets: int, frac: float,
                  seed: int) -> FidelityPlan:
    """Step 2: which rows are left out, one at a time (top, bottom, random by the primary method's scores) and in
    seeded subsets of `frac` of the rows; each retrain writes its adapter under `work`."""
    rows = loo_rows(primary_scores, loo, seed) if loo > 0 else []
    m = max(1, int(round(frac * n)))
    subs = lds_subsets(n, m, subsets, seed) if subsets > 0 else []
    named = [("reference", [])] + [(f"loo-{p}", [p]) for p, _ in rows] + [(f"lds-{j}", S) for j, S in enumerate(subs)]
    return FidelityPlan(rows, subs, m, [RetrainJob(name, tuple(excl), work / name) for name, excl in named])


def retrain_losses(cfg: Config, s, qitems: list[QueryItem], plan: FidelityPlan, recipe,
                   user_adapter: Path) -> RetrainLosses:
    """Step 3: every retrain's query losses (`retrain_many`), one progress bar for the loop; each retrained adapter
    is deleted once measured."""
    from transformers.utils import logging as hf_logging

    from ..progress import progress_bar
    from ..setup.model import load_model

    def measure(job: RetrainJob, path: Path) -> tuple[np.ndarray, Optional[bool]]:
        same = adapters_equal(path, user_adapter) if job.name == "reference" else None
        model = load_model(cfg, str(path))
        try:
            return query_losses(model, s, qitems), same
        finally:
            del model
            shutil.rmtree(path, ignore_errors=True)

    settings = RetrainSettings(cfg, recipe, user_adapter, progress=False,
                               log_path=cfg.output_dir / "fidelity.train.log" if cfg.train.command else None)
    hf_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar for the whole loop, not a weight-loading bar per retrain
    with _restore_hf_bars(hf_bars), \
            progress_bar("fidelity retrains", total=len(plan.jobs), unit="retrains", split=True) as bar:
        done = retrain_many(settings, plan.jobs, measure, after=lambda j, r: bar.advance())
    return RetrainLosses({r.job.name: r.measured[0] for r in done},
                         next(r.measured[1] for r in done if r.job.name == "reference"),
                         sum(r.train_seconds for r in done), sum(r.measure_seconds for r in done))


def fidelity_result(cfg: Config, qitems: list[QueryItem], direction: str, precs: list[str], pred: Predictions,
                    plan: FidelityPlan, got: RetrainLosses, *, n: int, loo: int, frac: float, recipe_path: str,
                    started: float) -> dict:
    """Step 4: fidelity.json: predicted against actual changes, LOO correlations and LDS by method."""
    sign = direction_sign(direction)
    ref = got.losses["reference"]
    primary = precs[0]
    agg = pred.aggregate()

    def actual(name: str) -> np.ndarray:  # [Q]
        return sign * (ref - got.losses[name]) / pred.qnorm

    res: dict = {
        "schema": SCHEMA,
        "query_measure": ("per failing item: sign * (L_q(reference retrain) - L_q(retrain)) / |grad L_q|, with L_q = "
                          "loss(expected) - loss(generated) summed over tokens (contrastive) or loss(expected) "
                          "(classic); sign = +1 for a regression, -1 for an improvement"),
        "direction": direction,
        "n_rows": n,
        "n_items": len(qitems),
        "preconditioners": precs,
        "methods": list(pred.per_item),
        "reference": {"reproduced_bit_for_bit": bool(got.reference_equal),
                      "max_abs_query_loss_gap": float(np.max(np.abs(ref - pred.user_losses))) if len(ref) else 0.0},
        "recipe": recipe_path,
        "items": [q.item for q in qitems],
        "query_grad_norms": [float(x) for x in pred.qnorm],
        "reference_query_losses": [float(x) for x in ref],
    }
    rows = plan.rows
    if rows:
        act = np.array([actual(f"loo-{p}").mean() for p, _ in rows])
        by = {p: correlations(np.array([agg[p][z] for z, _ in rows]), act) for p in pred.per_item}
        res["loo"] = {
            "rows_per_group": loo, "n": len(rows), "pearson": by[primary]["pearson"],
            "spearman": by[primary]["spearman"], "by_preconditioner": by,
            "rows": [{"position": z, "group": g, "predicted": float(agg[primary][z]), "actual": float(a),
                      "actual_items": [round(float(x), 8) for x in actual(f"loo-{z}")]}
                     for (z, g), a in zip(rows, act)],
        }
    subs = plan.subsets
    if subs:
        A = np.stack([actual(f"lds-{j}") for j in range(len(subs))])  # [J, Q]
        by = {p: lds(pred.per_item[p], subs, A) for p in pred.per_item}
        oracle = truth_oracle(cfg, [q.item for q in qitems], subs, A)
        res["lds"] = {"subsets": len(subs), "subset_size": plan.subset_size, "fraction": frac,
                      "lds": by[primary]["lds"], "by_preconditioner": by, "truth_oracle": oracle, "removed": subs,
                      "actual": [[round(float(x), 8) for x in row] for row in A]}
    res["timings"] = {"retrain": round(got.train_seconds, 2), "measure": round(got.measure_seconds, 2),
                      "retrains": len(plan.jobs), "total": round(time.time() - started, 2)}
    return res


def run_fidelity(cfg: Config, *, loo: int = 20, subsets: int = 50, frac: float = 0.05,
                 preconditioners: Optional[list[str]] = None, console=None) -> dict:
    """LOO and LDS retrains against the scores' predictions; writes OUT/fidelity.json and OUT/report.html."""
    from ..setup.session import open_session

    t_all = time.time()
    report = read_report(cfg, "check")
    recipe, recipe_path = retrain_recipe(cfg)
    user_adapter = Path(cfg.local_or_hub(cfg.model.adapter, "model.adapter"))
    precs = checked_preconditioners(cfg, preconditioners)
    say = console.print if console is not None else (lambda *a, **kw: None)
    s = open_session(cfg)
    qitems, direction = report_queries(report)
    n = len(s.examples)
    pred = predictions(s, qitems, direction, precs)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fidelity-retrains-", dir=cfg.output_dir))
    with _removed_after(work):
        plan = fidelity_plan(pred.aggregate()[precs[0]], n, work, loo=loo, subsets=subsets, frac=frac, seed=cfg.seed)
        say(f"fidelity: {len(plan.jobs)} deterministic retrains (1 reference, {len(plan.rows)} leave-one-out, "
            f"{len(plan.subsets)} leave-{plan.subset_size}-out)")
        got = retrain_losses(cfg, s, qitems, plan, recipe, user_adapter)
    res = fidelity_result(cfg, qitems, direction, precs, pred, plan, got, n=n, loo=loo, frac=frac,
                          recipe_path=str(recipe_path), started=t_all)
    if dist_.current().is_main:
        atomic_write_text(cfg.output_dir / "fidelity.json", json.dumps(res, indent=2))
        from .verify import rewrite_html

        rewrite_html(cfg.output_dir)
    dist_.barrier()
    return res
