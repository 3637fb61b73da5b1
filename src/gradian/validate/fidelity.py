"""`gradian fidelity`: do the attribution scores predict what retraining actually does?

Two measurements, both on deterministic retrains with the adapter's recipe (rows removed by zero-weighting in
place, so the only difference between two retrains is the removed rows; see :mod:`gradian.verify`):

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

Preconditioners: scores are recomputed with `api.score_items` (the per-item inner products, without the
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
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .config import Config
from .report import atomic_write_text
from .verify import VerifyError, adapters_equal, load_recipe, read_report, retrain

SCHEMA = "gradian.fidelity/1"


def _corr(x: Sequence[float], y: Sequence[float]) -> dict:
    from scipy.stats import pearsonr, spearmanr

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return {"pearson": None, "spearman": None, "n": int(x.size)}
    return {"pearson": float(pearsonr(x, y)[0]), "spearman": float(spearmanr(x, y)[0]), "n": int(x.size)}


def preconditioner_available(name: str) -> bool:
    if name == "identity":
        return True
    try:
        import importlib

        importlib.import_module("gradian.precondition")
        return True
    except ImportError:
        return False


def _query_items(report: dict):
    from .query import QueryItem

    q = report.get("query") or {}
    items = [QueryItem(int(it["item"]), it["prompt"], it["expected"], it["generated"], it.get("base_generated", ""),
                       it.get("formulation") or q.get("formulation", "contrastive")) for it in q.get("items") or []]
    if not items:
        raise VerifyError("report.json lists no failing items in query.items; rerun `gradian attribute CONFIG`")
    return items, q.get("direction") or "regression"


def query_losses(model, s, qitems) -> np.ndarray:
    """[Q] query loss of each failing item under `model`: the function `query.query_vectors` differentiates
    (contrastive, classic or margin), through `query.query_losses`."""
    from .query import query_losses as _losses

    return _losses(model, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=s.cfg.grads.max_seq_length,
                   batch_size=s.cfg.grads.batch_size)


def _scores_for(s, capture, idx, row_keys, qitems, direction: str, preconditioner: str) -> np.ndarray:
    """Per-item scores [Q, N] with the given preconditioner, through the same code path as `attribute`."""
    from .api import score_items

    saved = s.cfg
    s.cfg = saved.model_copy(deep=True)
    s.cfg.root = saved.root
    s.cfg.attribution.preconditioner = preconditioner
    try:
        sc = score_items(s, capture, idx, row_keys, qitems, direction, details=True)
        from .checkpoints import apply as over_checkpoints

        over_checkpoints(s, sc, qitems, direction)  # attribution.checkpoints: the scores `attribute` reports
        per_item = sc.per_item
    finally:
        s.cfg = saved
    return np.asarray(per_item, dtype=np.float64)


def loo_rows(agg: np.ndarray, k: int, seed: int) -> list[tuple[int, str]]:
    """Top k, bottom k and k random others (seeded), without repeats."""
    from .scoring import rank

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
    agg = _corr(pred.mean(axis=0), actual.mean(axis=1))
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


def run_fidelity(cfg: Config, *, loo: int = 20, subsets: int = 50, frac: float = 0.05,
                 preconditioners: Optional[list[str]] = None, console=None) -> dict:
    from . import api
    from .modeling import load_model
    from .progress import progress_bar
    from .query import query_vectors
    from transformers.utils import logging as hf_logging

    t_all = time.time()
    report = read_report(cfg, "check")
    recipe, recipe_path = load_recipe(cfg)
    user_adapter = Path(cfg.local_or_hub(cfg.model.adapter, "model.adapter"))
    precs = preconditioners or [cfg.attribution.preconditioner]
    import typing

    from .config import AttributionConfig

    known = typing.get_args(AttributionConfig.model_fields["preconditioner"].annotation)
    for p in precs:
        if p not in known:
            raise VerifyError(f"--preconditioner {p}: unknown; one of {', '.join(known)}")
        if not preconditioner_available(p):
            raise VerifyError(f"--preconditioner {p}: this build has no gradian.precondition module; use identity")
    say = console.print if console is not None else (lambda *a, **kw: None)

    s = api.open_session(cfg)
    qitems, direction = _query_items(report)
    sign = -1.0 if direction == "improvement" else 1.0
    n = len(s.examples)
    capture, idx, row_keys, _ = api.index(s)
    try:
        per_item = {p: _scores_for(s, capture, idx, row_keys, qitems, direction, p) for p in precs}
        qv = query_vectors(capture, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=cfg.grads.max_seq_length,
                           batch_size=cfg.grads.batch_size).numpy()
    finally:
        idx.close()
    qnorm = np.maximum(np.linalg.norm(qv.astype(np.float64), axis=1), 1e-30)
    l_user = query_losses(s.model, s, qitems)
    s.model = None  # free it: each retrain is loaded on its own

    primary = precs[0]
    agg = {p: v.mean(axis=0) for p, v in per_item.items()}
    rows = loo_rows(agg[primary], loo, cfg.seed) if loo > 0 else []
    m = max(1, int(round(frac * n)))
    subs = lds_subsets(n, m, subsets, cfg.seed) if subsets > 0 else []
    jobs = [("reference", [])] + [(f"loo-{p}", [p]) for p, _ in rows] + [(f"lds-{j}", S) for j, S in enumerate(subs)]
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fidelity-retrains-", dir=cfg.output_dir))
    say(f"fidelity: {len(jobs)} deterministic retrains (1 reference, {len(rows)} leave-one-out, {len(subs)} "
        f"leave-{m}-out)")
    losses: dict[str, np.ndarray] = {}
    ref_equal = None
    t_train = t_meas = 0.0
    hf_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar for the whole loop, not a weight-loading bar per retrain
    with _restore_hf_bars(hf_bars), _removed_after(work), \
            progress_bar("fidelity retrains", total=len(jobs), unit="retrains") as bar:
        for name, excl in jobs:
            t0 = time.time()
            path = retrain(cfg, recipe, excl, work / "adapter", user_adapter, progress=False)
            t1 = time.time()
            if name == "reference":
                ref_equal = adapters_equal(path, user_adapter)
            model = load_model(cfg, str(path))
            losses[name] = query_losses(model, s, qitems)
            del model
            t_train += t1 - t0
            t_meas += time.time() - t1
            bar.advance()

    ref = losses["reference"]

    def actual(name: str) -> np.ndarray:  # [Q]
        return sign * (ref - losses[name]) / qnorm

    res: dict = {
        "schema": SCHEMA,
        "query_measure": ("per failing item: sign * (L_q(reference retrain) - L_q(retrain)) / |grad L_q|, with L_q = "
                          "loss(expected) - loss(generated) summed over tokens (contrastive) or loss(expected) "
                          "(classic); sign = +1 for a regression, -1 for an improvement"),
        "direction": direction,
        "n_rows": n,
        "n_items": len(qitems),
        "preconditioners": precs,
        "reference": {"reproduced_bit_for_bit": bool(ref_equal),
                      "max_abs_query_loss_gap": float(np.max(np.abs(ref - l_user))) if len(ref) else 0.0},
        "recipe": str(recipe_path),
        "items": [q.item for q in qitems],
        "query_grad_norms": [float(x) for x in qnorm],
        "reference_query_losses": [float(x) for x in ref],
    }
    same = [p for p in precs[1:] if np.array_equal(per_item[p], per_item[primary])]
    if same:
        res["note"] = (f"preconditioner(s) {', '.join(same)} gave exactly the scores of {primary}: the scoring path "
                       "(api.score_items) does not apply attribution.preconditioner yet")
    if rows:
        act = np.array([actual(f"loo-{p}").mean() for p, _ in rows])
        by = {}
        for p in precs:
            pred = np.array([agg[p][z] for z, _ in rows])
            by[p] = _corr(pred, act)
        res["loo"] = {
            "rows_per_group": loo, "n": len(rows), "pearson": by[primary]["pearson"],
            "spearman": by[primary]["spearman"], "by_preconditioner": by,
            "rows": [{"position": z, "group": g, "predicted": float(agg[primary][z]), "actual": float(a),
                      "actual_items": [round(float(x), 8) for x in actual(f"loo-{z}")]}
                     for (z, g), a in zip(rows, act)],
        }
    if subs:
        A = np.stack([actual(f"lds-{j}") for j in range(len(subs))])  # [J, Q]
        by = {p: lds(per_item[p], subs, A) for p in precs}
        oracle = truth_oracle(cfg, [q.item for q in qitems], subs, A)
        res["lds"] = {"subsets": len(subs), "subset_size": m, "fraction": frac, "lds": by[primary]["lds"],
                      "by_preconditioner": by, "truth_oracle": oracle, "removed": subs,
                      "actual": [[round(float(x), 8) for x in row] for row in A]}
    res["timings"] = {"retrain": round(t_train, 2), "measure": round(t_meas, 2), "retrains": len(jobs),
                      "total": round(time.time() - t_all, 2)}
    atomic_write_text(cfg.output_dir / "fidelity.json", json.dumps(res, indent=2))
    from .verify import _rewrite_html

    _rewrite_html(cfg.output_dir)
    return res


def print_fidelity(res: dict, console) -> None:
    from rich.table import Table

    def f(x):
        return "-" if x is None else f"{x:+.3f}"

    t = Table(title=f"fidelity: predicted vs actual change on deterministic retrains ({res['n_items']} failing items)")
    t.add_column("preconditioner")
    t.add_column("LOO Pearson", justify="right")
    t.add_column("LOO Spearman", justify="right")
    t.add_column("LDS (Spearman, mean over items)", justify="right")
    t.add_column("LDS of the items' mean", justify="right")
    for p in res["preconditioners"]:
        lo = (res.get("loo") or {}).get("by_preconditioner", {}).get(p, {})
        ld = (res.get("lds") or {}).get("by_preconditioner", {}).get(p, {})
        t.add_row(p, f(lo.get("pearson")), f(lo.get("spearman")), f(ld.get("lds")), f(ld.get("aggregate_spearman")))
    console.print(t)
    parts = []
    if res.get("loo"):
        parts.append(f"LOO on {res['loo']['n']} rows (top, bottom and random {res['loo']['rows_per_group']})")
    if res.get("lds"):
        parts.append(f"LDS over {res['lds']['subsets']} subsets of {res['lds']['subset_size']} rows removed"
                     + (f" (a predictor that knows the planted rows scores {res['lds']['truth_oracle']:+.3f})"
                        if res["lds"].get("truth_oracle") is not None else ""))
    ref = res["reference"]
    parts.append("the reference retrain reproduces the adapter bit for bit" if ref["reproduced_bit_for_bit"]
                 else "the reference retrain differs from the adapter; actual changes are measured against it")
    console.print("; ".join(parts) + f" ({res['timings']['retrains']} retrains, {res['timings']['total']:.0f}s)",
                  style="dim")
