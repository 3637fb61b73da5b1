"""Are the accused rows that a scenario did not plant causes too? Retrain without them and see.

    .venv/bin/python bench/counterfactual.py --run WORK/smol_paraphrase   # a run of bench/real_models.py
    .venv/bin/python bench/counterfactual.py --smoke    # bench/_smoke.py's tiny scenario: 3 retrains of 2 rows

A scenario's truth lists the rows it planted; a report may accuse others. An accused row that is not planted is only
innocent if the model does not need it: this bench retrains the scenario's recipe (TRL or gradian's loop, removal in
place as `verify` does it) three times, each time without one set of rows, and re-measures the eval:

* ``unplanted``: the accused rows the scenario did not plant;
* ``planted``: the planted rows (all of them, accused or not);
* ``random``: as many random rows as ``unplanted``, drawn from the rows that are neither accused nor planted;
* ``given``: the rows of ``--rows`` (e.g. a top row that the truth does not list);
* ``gradian``, ``bm25``, ``bm25_question``, ``repsim``: each method's top ``--k`` rows (default: as many as planted)
  on the report's failing items (Gradian's ranking from ``scores.npy``; the baselines of
  ``gradian.explain.baselines``): where the planted truth is disputed, the removal that repairs more broken items
  names more of the cause.

``--train-seed N`` retrains every set under data-order seed N instead of the recipe's, and the whole set too
(``full``): the items the fine-tune broke are then those the full retrain at N breaks, so a difference between two
removals can be told from what one retrain's data order does (results under ``counterfactual/seedN/``). Each
retrain's measurement is kept beside its adapter (``measured.json``) and reused by a later run asking for the same
set, so two processes can share the sets of one seed.

For each set it prints how many of the items the fine-tune broke (base passes, fine-tune fails) the retrain repairs
(passes again), and the eval's capability. If removing the unplanted accused rows repairs items and the random set
does not, those rows are causes of the failure and the truth file is incomplete, not the report wrong. One torch
thread; CPU seconds per retrain. Prints ONE JSON object as the last line.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="a scenario directory of bench/real_models.py (with bench-out/)")
    ap.add_argument("--sets", default="unplanted,planted,random", help="which retrains, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out", help="the run's report directory (relative to --run)")
    ap.add_argument("--k", type=int, default=0, help="rows per method's top-k set (0: as many as planted)")
    ap.add_argument("--rows", default="",
                    help="comma-separated row positions: the set 'given' (add it to --sets) retrains without them, "
                         "e.g. a top row the truth does not list")
    ap.add_argument("--train-seed", type=int, default=None,
                    help="retrain every set and the whole set ('full') under this data-order seed")
    ap.add_argument("--sets-only", action="store_true",
                    help="print each set's rows and which sets are the same removal (a deterministic retrain of the "
                         "same rows repairs the same items), and retrain nothing")
    ap.add_argument("--smoke", action="store_true",
                    help="on bench/_smoke.py's tiny scenario: --sets planted,gradian,bm25 --k 2 (checks the script)")
    args = ap.parse_args()
    if args.smoke:
        from _smoke import tiny_run

        args.run, args.sets, args.k = str(tiny_run()), "planted,gradian,bm25", 2
    if not args.run:
        ap.error("--run is required (or --smoke)")

    from gradian.config import load_config
    from gradian.report.read import load_report
    from gradian.setup.session import open_session
    from gradian.validate.retrain import RetrainJob, RetrainSettings, measure_adapter, retrain_many, retrain_recipe

    run = Path(args.run).resolve()
    rep = load_report(run / args.out)
    planted = sorted(json.loads((run / "truth.json").read_text())["planted"])
    accused = sorted(rep.accused.positions)
    cfg = load_config(run / "gradian.yaml", [f"output={args.out}"])
    s = open_session(cfg, load_model_=False)
    n = len(s.examples)
    items = rep.capability.items
    base = np.array([float(it.base_score) for it in items])
    tuned = np.array([float(it.tuned_score) for it in items])
    broken = np.flatnonzero((base > 0.5) & (tuned < 0.5))
    unplanted = [p for p in accused if p not in planted]
    rng = np.random.default_rng(args.seed)
    pool = [i for i in range(n) if i not in set(accused) | set(planted)]
    sets = {"unplanted": unplanted, "planted": planted,
            "random": sorted(int(x) for x in rng.choice(pool, size=len(unplanted), replace=False))}
    wanted = [x for x in args.sets.split(",") if x]
    if args.rows:
        sets["given"] = sorted({int(x) for x in args.rows.split(",") if x.strip()})
        wanted = wanted if "given" in wanted else wanted + ["given"]
    k = args.k or len(planted)
    if "gradian" in wanted:
        sets["gradian"] = top_k(np.load(run / args.out / "scores.npy"), k)
    methods = [m for m in ("bm25", "bm25_question", "repsim") if m in wanted]
    if methods:
        from gradian.attribution.scoring import aggregate
        from gradian.explain.baselines import compute_baselines

        bs = s if "repsim" not in methods else open_session(cfg)
        per = compute_baselines(bs, [it.model_dump(by_alias=True, exclude_unset=True) for it in rep.query.items],
                                which=methods)
        sets.update({m: top_k(aggregate(per[m]), k) for m in methods})
    if args.sets_only:
        same = [[a, b] for i, a in enumerate(wanted) for b in wanted[i + 1:] if sets.get(a) == sets.get(b)]
        for name in wanted:
            got = sets.get(name, [])
            print(f"  {name:13s} {len(got):2d} rows, {len(set(got) & set(planted))} planted: {got}", flush=True)
        print(json.dumps({"run": str(run), "planted": planted, "sets": {m: sets.get(m) for m in wanted},
                          "same_removal": same}))
        return
    recipe, _ = retrain_recipe(cfg)
    work = run / "counterfactual"  # one folder per set: runs of different sets can share it
    if args.train_seed is not None:
        recipe = reseeded(recipe, args.train_seed)
        work = work / f"seed{args.train_seed}"
        sets["full"] = []
        wanted = wanted if "full" in wanted else ["full"] + wanted  # listed: in the order given
    user_adapter = Path(cfg.local_or_hub(cfg.model.adapter, "model.adapter"))
    out = {"run": str(run), "rows": n, "planted": planted, "accused": accused, "broken_items": broken.tolist(),
           "base": float(base.mean()), "tuned": float(tuned.mean()), "retrains": {}}
    print(f"{run.name}: {n} rows, {len(planted)} planted, {len(accused)} accused ({len(unplanted)} not planted); "
          f"{len(broken)} items broken by the fine-tune; capability {base.mean():.3f} -> {tuned.mean():.3f}",
          flush=True)
    jobs = [RetrainJob(name, tuple(sets[name]), work / name) for name in wanted]
    got = {}

    def keep(j: int, r) -> None:
        got[r.job.name] = {"exclude": list(r.job.exclude), "scores": list(map(float, r.measured[0])),
                           "answers": list(r.measured[1]), "train_cpu_s": round(r.train_cpu_seconds, 1),
                           "eval_cpu_s": round(r.measure_cpu_seconds, 1), "train_seed": args.train_seed}
        (r.job.out_dir / "measured.json").write_text(json.dumps(got[r.job.name]))
        print(f"  retrained without {r.job.name} ({len(r.job.exclude)} rows): {r.train_cpu_seconds:.0f} CPU s",
              flush=True)

    settings = RetrainSettings(cfg, recipe, user_adapter, progress=False)
    for job in jobs:  # one at a time, each looked up when its turn comes: another process may have measured it
        got[job.name] = kept(job)
        if got[job.name] is None:
            retrain_many(settings, [job], lambda job, path: measure_adapter(cfg, path, s), after=keep)
    if args.train_seed is not None:  # the items the whole set's retrain at this seed breaks
        full = np.array(got["full"]["scores"])
        broken = np.flatnonzero((base > 0.5) & (full < 0.5))
        out["broken_items"], out["tuned"] = broken.tolist(), float(full.mean())
        print(f"  data-order seed {args.train_seed}: the full retrain breaks {len(broken)} items "
              f"({broken.tolist()}), capability {full.mean():.3f}", flush=True)
    for name in wanted:
        g = got[name]
        sc = np.array(g["scores"])
        repaired = [int(i) for i in broken if sc[i] > 0.5]
        out["retrains"][name] = {"excluded": g["exclude"], "repaired": len(repaired), "of": len(broken),
                                 "repaired_items": repaired, "capability": float(sc.mean()),
                                 "answers": {int(i): g["answers"][i] for i in broken},
                                 "train_cpu_s": g["train_cpu_s"], "eval_cpu_s": g["eval_cpu_s"]}
        print(f"  without {name:9s} ({len(g['exclude']):2d} rows): repaired {len(repaired):2d}/{len(broken)} broken "
              f"items, capability {sc.mean():.3f}; train {g['train_cpu_s']:.0f} CPU s", flush=True)
    print(json.dumps(out))


def reseeded(recipe, seed: int):
    """The recipe under another data-order seed (and a recorded Trainer run's `seed` argument with it)."""
    upd = {"seed": int(seed)}
    ta = getattr(recipe, "trainer_args", None)
    if isinstance(ta, dict):
        upd["trainer_args"] = {**ta, "seed": int(seed)}
    return recipe.model_copy(update=upd)


def kept(job) -> "dict | None":
    """A retrain's measurement saved by an earlier run of this set (same rows removed), else None."""
    f = Path(job.out_dir) / "measured.json"
    if not f.exists():
        return None
    g = json.loads(f.read_text())
    return g if g.get("exclude") == list(job.exclude) else None


def top_k(scores: np.ndarray, k: int) -> list[int]:
    """The k highest-scoring rows (ties by position), in position order."""
    return sorted(int(p) for p in np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")[:k])


if __name__ == "__main__":
    main()
