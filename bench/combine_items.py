"""How the failing items' scores combine into a row's ranking (`attribution.combine`), measured on the per-item
scores `attribute` computes.

    .venv/bin/python bench/combine_items.py RUN [RUN ...]     # a run of bench/real_models.py or bench/fidelity.py
    .venv/bin/python bench/combine_items.py --smoke           # the tiny scenario of bench/_smoke.py (seconds)

Each RUN is a scenario directory with gradian.yaml and truth.json (its adapter trained). The script runs
`attribute`'s own stages up to the scores (`pipeline.capability_stage`, `query_stage`, `rank_stage`, with the
config's defaults) and keeps each item's ranking scores [Q, N] (`Ranking.per_item`: best window or exchange per item
where the run ranks by them) in RUN/combine/rank_item.npy, reused by a later run (delete it after retraining). It
then prints, per run, the AUPRC of the planted rows under each way of combining the items:

* ``mean``: the mean over items (`attribution.combine: mean`; auto for behaviour queries);
* ``max z``: each item's scores as robust z-scores against its own rows, then the max (`max`; auto for own-words
  queries);
* ``max raw``: the max of the raw scores; ``mean z``: the mean of the z-scores; ``top2``: the mean of each row's
  two best items; ``l4+``: the L4 norm of the positive parts (candidates measured, not shipped).

Then how many rows each candidate count rule accuses (planted / accused, the accused being that many rows from the
top of the ``max z`` ranking) and the margin it has to work with:

* ``scan + drop``: the shipped rule since issue 42 (`accused.accuse`: scan statistic over items, widest drop);
* ``mean's count``: rows whose items' mean is more than 6 robust sd above the median (shipped before issue 42);
* ``max z > 6``: rows whose strongest item's robust z exceeds 6; ``max z > 6 (Q)``: the same threshold corrected
  for the max over Q items (the normal quantile of Q times the one-item tail of 6 sd);
* ``z of max z > 6``: the robust z of the max-z scores themselves against all rows;
* ``planted min / benign max``: the lowest planted row's and the highest benign row's strongest-item z: no rule on
  the strongest item alone can accuse every planted row of one run and no benign row of another when a planted
  minimum sits below another run's benign maximum.

One torch thread; prints ONE JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def rank_item(run: Path) -> tuple[np.ndarray, bool]:
    """(the run's per-item ranking scores [Q, N], own-words queries); computed once, then read from RUN/combine."""
    from gradian.config import load_config
    from gradian.pipeline import capability_stage, query_stage, rank_stage
    from gradian.setup.session import open_session

    out = run / "combine"
    f, meta = out / "rank_item.npy", out / "meta.json"
    if f.exists() and meta.exists():
        return np.load(f), bool(json.loads(meta.read_text())["own_words"])
    cfg = load_config(run / "gradian.yaml", ["output=combine"])
    s = open_session(cfg)
    outcome = capability_stage(s)
    if outcome.verdict != "attributed":
        raise SystemExit(f"{run}: verdict {outcome.verdict}: nothing to rank")
    queries = query_stage(s, outcome)
    ranked = rank_stage(s, outcome, queries)
    ri = np.asarray(ranked.ranking.per_item, dtype=np.float32)
    own = all(q.own_words for q in queries.items)
    out.mkdir(exist_ok=True)
    np.save(f, ri)
    meta.write_text(json.dumps({"own_words": own, "items": int(ri.shape[0]), "rows": int(ri.shape[1]),
                                "item_ids": [int(q.item) for q in queries.items],
                                "generated": [q.generated for q in queries.items]}))
    return ri, own


def control_item(run: Path) -> tuple[Optional[np.ndarray], list[int]]:
    """(each control item's scores [C, N], the control items' eval positions): the eval items both models pass,
    each scored like a failing item with the fine-tune's own answer as the target (`classic` on what the fine-tune
    said), signed so that a positive score made that passing answer likelier. A row that stands out on the failing
    items only because it pushes every answer of the task (a true fact of the same kind, a row of the answers'
    form) stands out on these too. Computed once, then read from RUN/combine/ctrl_item.npy (None: no item passes
    under both models). Costs a scoring pass of its own over the rows (a later question where RUN's per-row store
    answers it)."""
    from gradian.attribution.formulation import Formulation
    from gradian.attribution.queries import new_query
    from gradian.config import load_config
    from gradian.pipeline import capability_stage, score_stage
    from gradian.setup.session import open_session

    out = run / "combine"
    f, meta = out / "ctrl_item.npy", out / "ctrl_meta.json"
    if meta.exists():
        items = json.loads(meta.read_text())["items"]
        return (np.load(f) if items else None), items
    cfg = load_config(run / "gradian.yaml", ["output=combine"])
    s = open_session(cfg)
    outcome = capability_stage(s)
    cap = outcome.result
    b, t = cap.base_scores, cap.tuned_scores
    gen = cap.tuned_generated or [""] * len(b)
    base_gen = cap.base_generated or [""] * len(b)
    failing = set(outcome.failing)
    passing = [i for i in range(len(s.eval_items)) if i not in failing and t[i] > 0 and t[i] >= b[i]]
    qs = [new_query(s.eval_items[i].position, s.eval_items[i].question_text(), s.eval_items[i].answer, gen[i],
                    base_gen[i], Formulation.classic, target=gen[i] or s.eval_items[i].answer, target_source="tuned")
          for i in passing]
    out.mkdir(exist_ok=True)
    ci = None
    if qs:
        # "improvement": the harm sign that makes a row that raised the target's likelihood positive
        ci = np.asarray(score_stage(s, qs, "improvement", combine="max").per_item, dtype=np.float32)
        np.save(f, ci)
    items = [int(s.eval_items[i].position) for i in passing]
    meta.write_text(json.dumps({"items": items, "generated": [q.generated for q in qs]}))
    return ci, items


def combinations(per: np.ndarray) -> dict[str, np.ndarray]:
    from gradian.attribution.scoring import combine_items, item_z

    per = per.astype(np.float64)
    top = np.sort(per, axis=0)[::-1]
    return {"mean": combine_items(per, "mean"), "max z": combine_items(per, "max"), "max raw": per.max(0),
            "mean z": item_z(per).mean(0), "top2": top[:2].mean(0),
            "l4+": np.mean(np.maximum(per, 0.0) ** 4, axis=0) ** 0.25}


def count_rules(per: np.ndarray) -> dict[str, int]:
    """How many rows each candidate count rule accuses (module docstring)."""
    from scipy.stats import norm

    from gradian.attribution.accused import A_MIN as Z_ACCUSED, accuse
    from gradian.attribution.scoring import combine_items, robust_z

    def accused_count(v: np.ndarray) -> int:  # the rule before issue 42: robust z over all rows above 6
        return int((robust_z(v)[0] > Z_ACCUSED).sum())

    per = per.astype(np.float64)
    mx = combine_items(per, "max")
    t_q = float(norm.isf(min(1.0, per.shape[0] * norm.sf(Z_ACCUSED))))
    return {"scan + drop (shipped)": accuse(per, list(range(per.shape[0]))).count,
            "mean's count": accused_count(per.mean(0)), "max z > 6": int((mx > Z_ACCUSED).sum()),
            "max z > 6 (Q)": int((mx > t_q).sum()), "z of max z > 6": accused_count(mx)}


def fmt1(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--smoke", action="store_true", help="on the tiny scenario of bench/_smoke.py: checks the script")
    args = ap.parse_args()
    if args.smoke:
        from _smoke import tiny_run

        args.runs = [tiny_run()]
    if not args.runs:
        ap.error("give at least one RUN (or --smoke)")
    from gradian.attribution.scoring import auprc, rank, resolve_combine

    res = {}
    names = None
    for run in args.runs:
        run = run.resolve()
        per, own = rank_item(run)
        planted = json.loads((run / "truth.json").read_text())["planted"]
        got = {k: auprc(v, planted) for k, v in combinations(per).items()}
        names = names or list(got)
        mx = combinations(per)["max z"]
        order = rank(mx)
        accused = {k: [int(len(set(order[:c].tolist()) & set(planted))), int(c)] for k, c in count_rules(per).items()}
        benign = np.delete(mx, planted)
        res[run.name] = {"items": int(per.shape[0]), "rows": int(per.shape[1]), "planted": len(planted),
                         "auto": resolve_combine("auto", [own]), "auprc": got, "accused": accused,
                         "planted_min_max_z": float(mx[planted].min()) if planted else None,
                         "benign_max_max_z": float(benign.max()) if benign.size else None}
    print("| run | items | rows | auto | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for name, r in res.items():
        print(f"| {name} | {r['items']} | {r['rows']} | {r['auto']} | "
              + " | ".join(f"{r['auprc'][k]:.3f}" for k in names) + " |")
    rules = list(next(iter(res.values()))["accused"]) if res else []
    print()
    print("| run | " + " | ".join(rules) + " | planted min / benign max (max z) |")
    print("|---|" + "---|" * len(rules) + "---|")
    for name, r in res.items():
        print(f"| {name} | " + " | ".join(f"{r['accused'][k][0]} / {r['accused'][k][1]}" for k in rules)
              + f" | {fmt1(r['planted_min_max_z'])} / {fmt1(r['benign_max_max_z'])} |")
    print(json.dumps({"bench": "combine_items", "results": res}))


if __name__ == "__main__":
    main()
