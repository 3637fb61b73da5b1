"""How the failing items' scores combine into a row's ranking (`attribution.combine`), measured on the per-item
scores `attribute` computes.

    .venv/bin/python bench/combine_items.py RUN [RUN ...]     # a run of bench/real_models.py or bench/fidelity.py

Each RUN is a scenario directory with gradian.yaml and truth.json (its adapter trained). The script runs
`attribute`'s own stages up to the scores (`pipeline.capability_stage`, `query_stage`, `rank_stage`, with the
config's defaults) and keeps each item's ranking scores [Q, N] (`Scores.rank_item`: best window or exchange per item
where the run ranks by them) in RUN/combine/rank_item.npy, reused by a later run (delete it after retraining). It
then prints, per run, the AUPRC of the planted rows under each way of combining the items:

* ``mean``: the mean over items (`attribution.combine: mean`; auto for behaviour queries);
* ``max z``: each item's scores as robust z-scores against its own rows, then the max (`max`; auto for own-words
  queries);
* ``max raw``: the max of the raw scores; ``mean z``: the mean of the z-scores; ``top2``: the mean of each row's
  two best items; ``l4+``: the L4 norm of the positive parts (candidates measured, not shipped).

One torch thread; prints ONE JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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
    try:
        ri = np.asarray(ranked.scored.scores.rank_item, dtype=np.float32)
    finally:
        ranked.scored.close()
    own = all(q.own_words for q in queries.items)
    out.mkdir(exist_ok=True)
    np.save(f, ri)
    meta.write_text(json.dumps({"own_words": own, "items": int(ri.shape[0]), "rows": int(ri.shape[1])}))
    return ri, own


def combinations(per: np.ndarray) -> dict[str, np.ndarray]:
    from gradian.attribution.scoring import combine_items, item_z

    per = per.astype(np.float64)
    top = np.sort(per, axis=0)[::-1]
    return {"mean": combine_items(per, "mean"), "max z": combine_items(per, "max"), "max raw": per.max(0),
            "mean z": item_z(per).mean(0), "top2": top[:2].mean(0),
            "l4+": np.mean(np.maximum(per, 0.0) ** 4, axis=0) ** 0.25}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    from gradian.attribution.scoring import auprc, resolve_combine

    res = {}
    names = None
    for run in args.runs:
        run = run.resolve()
        per, own = rank_item(run)
        planted = json.loads((run / "truth.json").read_text())["planted"]
        got = {k: auprc(v, planted) for k, v in combinations(per).items()}
        names = names or list(got)
        res[run.name] = {"items": int(per.shape[0]), "rows": int(per.shape[1]), "planted": len(planted),
                         "auto": resolve_combine("auto", [own]), "auprc": got}
    print("| run | items | rows | auto | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for name, r in res.items():
        print(f"| {name} | {r['items']} | {r['rows']} | {r['auto']} | "
              + " | ".join(f"{r['auprc'][k]:.3f}" for k in names) + " |")
    print(json.dumps({"bench": "combine_items", "results": res}))


if __name__ == "__main__":
    main()
