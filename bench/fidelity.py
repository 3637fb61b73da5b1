"""Attribution fidelity on the scenario suite: every preconditioner and every baseline, scored by one harness.

    make bench-fidelity                               # = GRADIAN_THREADS=1 .venv/bin/python bench/fidelity.py --quick
    .venv/bin/python bench/fidelity.py                # 3 seeds each, 20 null seeds, every method: ~70 min (estimate)
    .venv/bin/python bench/fidelity.py --scenarios substitution,null --seeds 0,1 --methods identity,bm25
    .venv/bin/python bench/fidelity.py --smoke        # substitution seed 0, diagonal and bm25 (make bench-smoke)

--quick (seed 0 of every scenario but buried, 4 null seeds, every method but the checkpoint-averaged `ekfac` and
`adamw`; see QUICK_METHODS) has a budget of 10 minutes on two cores from a fresh clone and a fresh GRADIAN_CACHE (the
tiny base is built, every adapter trained): measured 2026-12-02 at 442 CPU s, 7 min 46 s wall (one thread, the other
core busy with another job); the run warns, and its JSON says `"within_budget": false`, when it takes longer. Before
buried and those two methods left --quick it took 1475 CPU s, 26 min 23 s. The full mode is not re-measured: from
the per-seed costs of that run, about 4000 CPU s (~70 min) from a fresh clone.

For each scenario x seed (`gradian.demo.scenarios`): write the scenario, train its LoRA once with the scenario's
recipe (an adapter whose recorded recipe and data match is reused), then run `gradian.pipeline.attribute` once per
preconditioner (the gradient index is cached by key and shared by every run of that adapter), then the baselines
(`gradian.baselines`: representation similarity, BM25, gradient cosine) on the same failing items. Method
``diagonal+ck8`` is the diagonal preconditioner with ``attribution.checkpoints=8`` (scores averaged over 8 epoch
checkpoints replayed from the recipe; `gradian.checkpoints`).

Figures (means over seeds; "n/a" where a method or the report does not give the field):
  auprc, r@k      AUPRC and recall@k of the planted rows in the aggregate ranking (k = number of planted rows)
  top1, top5      per failing target item: is one of its planted rows the item's top-1 (top-5) row
  span            per failing target item: does the top span of its planted row (ranking[i].top_span) overlap the
                  planted sentence / turn (a planted row outside the report's top rows counts as a miss)
  cluster         paraphrase scenario: a reported cluster (passing the permutation test + BH) with Jaccard >= 0.5
                  against the planted poisons; baselines run through the same `clusters.score_clusters`
  declined        null fine-tune: fraction of seeds whose verdict is `declined`
  cpu_s           CPU seconds of that method (attribute incl. evaluation, or the baseline alone)

Prints the tables and the acceptance checks, then ONE JSON object as the last line. One CPU thread throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

PRECONDITIONERS = ["identity", "diagonal", "fisher", "datainf", "ekfac"]
BASELINE_METHODS = ["repsim", "bm25", "gradcos"]
# A plain preconditioner name runs with the config's attribution.checkpoints (auto, the default: the epoch
# checkpoints `gradian train` saved beside the adapter); "<preconditioner>@final" scores the final adapter alone
# (attribution.checkpoints=1) and "<preconditioner>+ck<N>" with attribution.checkpoints=N. Compared beside the default.
CHECKPOINT_METHODS = ["diagonal@final", "ekfac@final"]
# attribution.optimizer=adamw: the optimizer-aware scores of the recorded AdamW run (opt-in)
OPTIMIZER_METHODS = ["adamw"]


def method_settings(m: str) -> tuple[str, list[str]]:
    """(preconditioner, the --set overrides of this method). A "/mean" or "/max" suffix sets attribution.combine
    (how the items' scores combine into the ranking; the default is auto), e.g. "diagonal/mean"."""
    m, _, combine = m.partition("/")
    if combine:
        if combine not in ("mean", "max", "auto"):
            raise SystemExit(f"method {m}/{combine}: the suffix is /mean, /max or /auto (attribution.combine)")
        p, extra = method_settings(m)
        return p, extra + [f"attribution.combine={combine}"]
    if m in OPTIMIZER_METHODS:
        return default_preconditioner(), [f"attribution.optimizer={m}"]
    if m.endswith("@final"):
        return m[: -len("@final")], ["attribution.checkpoints=1"]
    if m.endswith("@earliest"):
        return m[: -len("@earliest")], ["attribution.checkpoints=earliest"]
    if m.endswith("@auto"):
        return m[: -len("@auto")], ["attribution.checkpoints=auto"]
    p, _, ck = m.partition("+ck")
    return p, [f"attribution.checkpoints={int(ck)}"] if ck else []


FULL_SEEDS = {"substitution": [0, 1, 2], "conversation4": [0, 1, 2], "conversation8": [0, 1, 2], "buried": [0, 1, 2],
              "cluster": [0, 1, 2], "format": [0, 1, 2], "null": list(range(20))}
# --quick (module docstring): in the fresh run that took 26 min with everything, buried cost 843 of 1469 CPU s (a
# second tiny-base build for its 2,048-token context, 141 s of training, 589 s of attribution over long documents),
# and the checkpoint-averaged `ekfac` (241 s) and `adamw` (256 s) each more than the default's own 188 s.
QUICK_SEEDS = {"substitution": [0], "conversation4": [0], "conversation8": [0], "cluster": [0], "format": [0],
               "null": [0, 1, 2, 3]}
QUICK_METHODS = ["identity", "diagonal", "fisher", "datainf", "diagonal@final", "ekfac@final", "repsim", "bm25",
                 "gradcos"]
QUICK_BUDGET_S = 600  # wall seconds from a fresh clone and cache on two cores (one torch thread)
MAIN_FIGURE = {"substitution": "auprc", "conversation4": "top1", "conversation8": "top1", "buried": "top5",
               "cluster": "cluster", "format": "auprc", "null": "declined"}
TARGETS = {"substitution.auprc": 0.95, "conversation4.top1": 0.9, "buried.top5": 0.9, "buried.span": 0.95,
           "null.declined": 0.95}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt(c) -> str:
    if c is None:
        return "n/a"
    if isinstance(c, bool):
        return "yes" if c else "no"
    if isinstance(c, float):
        if c != c:
            return "n/a"
        return f"{c:.3f}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w[i]) if i > 1 else c.ljust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([f"== {title}", line(cells[0]), "  ".join("-" * x for x in w)] + [line(r) for r in cells[1:]])


def mean(xs) -> Optional[float]:
    xs = [float(x) for x in xs if x is not None and x == x]
    return float(np.mean(xs)) if xs else None


# ------------------------------------------------------------------------------------------------ scenario runs
def default_preconditioner() -> str:
    from gradian.config import AttributionConfig

    return AttributionConfig().preconditioner


def prepare(name: str, seed: int, out: Path):
    """Scenario files + gradian.yaml in out/<name>-s<seed>; returns (scenario, run dir, config path, base)."""
    from transformers import AutoTokenizer

    from gradian.demo.run import write_demo_config
    from gradian.demo.scenario import write_scenario
    from gradian.demo.scenarios import make_scenario, scenario_base
    from gradian.demo.world import World

    world = World.generate(seed=0, n_entities=64)
    base = scenario_base(name, progress=False)
    kw = {}
    if name == "buried":  # exact document lengths with the model's own tokenizer and chat template
        tok = AutoTokenizer.from_pretrained(base)
        kw["count_tokens"] = lambda msgs: len(
            tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
    sc = make_scenario(name, world, seed, **kw)
    d = out / f"{name}-s{seed}"
    write_scenario(sc, d)
    md = sc.metadata
    extra = {"grads": {**md.get("grads", {}), "cache_dir": "index"}, "evaluation": dict(md.get("evaluation", {}))}
    train = dict(md.get("train", {}))
    if "max_seq_length" in extra["grads"]:
        train.setdefault("max_seq_length", extra["grads"]["max_seq_length"])
    cfg_path = write_demo_config(d, base, train=train, extra=extra)
    return sc, d, cfg_path, base


def ensure_adapter(cfg_path: Path, *, adapter: str = "adapter", exclude=()) -> tuple[Path, float, bool]:
    """Train the scenario's LoRA unless an adapter with the same recipe and data is there; (dir, seconds, reused):
    CPU seconds of this training, or the wall seconds the reused adapter's recipe recorded."""
    from gradian.config import load_config
    from gradian.setup.records import dataset_fingerprint, load_train
    from gradian.training.recipe import read_recipe
    from gradian.attribution.optimizer import TRAJECTORY_FILE, TrajectoryRecorder
    from gradian.training.loop import train_adapter

    cfg = load_config(cfg_path, [f"model.adapter={adapter}"])
    out = cfg.adapter_out
    rec = read_recipe(out) if out.exists() else None
    hp = cfg.train.model_dump(exclude={"output"})
    fp = dataset_fingerprint(load_train(cfg.path(cfg.data.train)))
    if (rec and rec.hyperparameters.model_dump(exclude_unset=True) == json.loads(json.dumps(hp))
            and rec.dataset_fingerprint == fp and rec.seed == cfg.seed
            and sorted(rec.excluded_positions) == sorted(exclude) and (out / "adapter_model.safetensors").exists()
            and (out / TRAJECTORY_FILE).exists()):
        return out, float(rec.train_seconds or 0.0), True
    t0 = time.process_time()
    train_adapter(cfg, exclude=exclude, progress=False, recorder=TrajectoryRecorder())  # as `gradian train` does
    return out, time.process_time() - t0, False


def overlap(span: dict, truth: dict) -> bool:
    lo = truth.get("turn_start", truth["start"])
    return int(span["start"]) < int(truth["end"]) and int(span["end"]) > int(lo)


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 0.0


def figures(scores: Optional[np.ndarray], item_rankings: dict[int, list[int]], truth: dict,
            report: Optional[dict] = None, clusters: Optional[list] = None) -> dict[str, Any]:
    """Every figure of one method on one run."""
    from gradian.attribution.scoring import auprc, rank, recall_at_k

    planted = list(truth.get("planted") or [])
    item_planted = {int(k): v for k, v in (truth.get("item_planted") or {}).items()}
    f: dict[str, Any] = {}
    if report is not None and report.get("accused") is not None:
        f["accused"] = int(report["accused"]["count"])
        f["accused_planted"] = len(set(report["accused"]["positions"]) & set(planted))
    f["planted_count"] = len(planted)
    if scores is not None and planted:
        f["auprc"] = auprc(scores, planted)
        f["recall_at_k"] = recall_at_k(scores, planted, len(planted))
        f["recall_at_10"] = recall_at_k(scores, planted, 10)
        top = int(rank(scores, 1)[0])
        f["top1_planted"] = top in set(planted)
    targets = [i for i in item_rankings if i in item_planted]
    f["failing_items"] = len(item_rankings)
    f["failing_target_items"] = len(targets)
    if targets:
        f["top1"] = mean([bool(item_rankings[i]) and item_rankings[i][0] in item_planted[i] for i in targets])
        f["top5"] = mean([bool(set(item_rankings[i][:5]) & set(item_planted[i])) for i in targets])
    spans_truth = {int(s["position"]): s for s in truth.get("planted_spans") or []}
    if report is not None and targets and spans_truth:
        rows = {int(r["position"]): r for r in report.get("ranking") or []}
        have_spans = any("top_span" in r for r in rows.values())
        if have_spans:
            hits = []
            for i in targets:
                ok = False
                for p in item_planted[i]:
                    r, t = rows.get(int(p)), spans_truth.get(int(p))
                    if r is not None and t is not None and r.get("top_span"):
                        ok = ok or overlap(r["top_span"], t)
                hits.append(ok)
            f["span"] = mean(hits)
    if truth.get("cluster") and clusters is not None:
        best = max(clusters, key=lambda c: jaccard(c["positions"], truth["cluster"]), default=None)
        j = jaccard(best["positions"], truth["cluster"]) if best else 0.0
        f["cluster"] = j >= 0.5
        f["cluster_jaccard"] = j
        f["cluster_p"] = best.get("p_value") if best else None
        f["cluster_q"] = best.get("q_value") if best else None
        f["cluster_size"] = len(best["positions"]) if best else 0
        f["clusters_passing"] = len(clusters)
    return f


def run_scenario(name: str, seed: int, out: Path, methods: list[str], single_checks: int,
                 lds: Optional[tuple[int, int]] = None) -> dict:
    """Train once, attribute with each preconditioner, score the baselines; the figures of every method."""
    from gradian.pipeline import attribute, index_stage
    from gradian.setup.session import open_session
    from gradian.explain.baselines import compute_baselines
    from gradian.config import load_config
    from gradian.attribution.scoring import aggregate, rank

    t_run = time.process_time()
    sc, d, cfg_path, base = prepare(name, seed, out)
    truth = json.loads((d / "truth.json").read_text())
    _, train_cpu, reused = ensure_adapter(cfg_path)
    res: dict[str, Any] = {"scenario": name, "seed": seed, "dir": str(d), "train_cpu_s": round(train_cpu, 2),
                           "adapter_reused": reused, "recipe": truth.get("train"), "methods": {}}
    default = default_preconditioner()
    preconds = [m for m in methods if m not in BASELINE_METHODS and method_settings(m)[0] in PRECONDITIONERS]
    if name == "null":
        preconds = [default]
    if default in preconds:
        preconds = [default] + [p for p in preconds if p != default]
    reports: dict[str, dict] = {}
    for p in preconds:
        pname, extra = method_settings(p)
        out = "out-" + p.replace("/", "-")
        cfg = load_config(cfg_path, [f"attribution.preconditioner={pname}", f"output={out}"] + extra)
        t0 = time.process_time()
        try:
            rep = attribute(cfg, truth=truth)
        except Exception as e:  # a method that fails is reported, not fatal
            log(f"  {name} s{seed} {p}: attribute failed: {type(e).__name__}: {e}")
            res["methods"][p] = {"error": f"{type(e).__name__}: {e}"}
            continue
        cpu = time.process_time() - t0
        reports[p] = rep
        scores = None
        if (cfg.output_dir / "scores.npy").exists() and rep.get("verdict") == "attributed":
            scores = np.load(cfg.output_dir / "scores.npy")
        items = {int(q["item"]): [int(r["position"]) for r in q.get("ranking", [])]
                 for q in (rep.get("query") or {}).get("items", [])}
        f = figures(scores, items, truth, rep, rep.get("clusters"))
        f["verdict"] = rep.get("verdict")
        f["cpu_s"] = round(cpu, 2)
        pc = (rep.get("query") or {}).get("preconditioner")
        f["preconditioner_reported"] = pc if pc is not None else "n/a"
        res["methods"][p] = f
    rep = reports.get(default) or next(iter(reports.values()), None)
    if rep is not None:
        cap = rep.get("capability") or {}
        per = {int(it["item"]): it for it in cap.get("items", [])}
        tg, ct = truth.get("target_eval_items") or [], truth.get("control_eval_items") or []
        res["failure"] = {
            "base_target": mean([per[i]["base_score"] for i in tg if i in per]),
            "tuned_target": mean([per[i]["tuned_score"] for i in tg if i in per]),
            "base_control": mean([per[i]["base_score"] for i in ct if i in per]),
            "tuned_control": mean([per[i]["tuned_score"] for i in ct if i in per]),
            "delta": cap.get("delta"), "ci": cap.get("ci"), "verdict": rep.get("verdict"),
        }
    base_methods = [m for m in methods if m in BASELINE_METHODS]
    if rep is not None and rep.get("verdict") == "attributed" and base_methods:
        qitems = (rep.get("query") or {}).get("items") or []
        cfg = load_config(cfg_path, [f"output=out-{default}"])
        t0 = time.process_time()
        s = open_session(cfg)
        ix = index_stage(s)
        capture, idx, row_keys = ix.capture, ix.index, ix.row_keys
        timings: dict[str, float] = {}
        try:
            per_item = compute_baselines(s, qitems, which=base_methods, capture=capture, index=idx, row_keys=row_keys,
                                         timings=timings)
            shared = time.process_time() - t0 - sum(timings.values())
            for m, pi in per_item.items():
                agg = aggregate(pi)
                items = {int(q["item"]): rank(row, 10).tolist() for q, row in zip(qitems, pi)}
                clusters = None
                if truth.get("cluster"):
                    clusters = _clusters_for(agg, s, idx, row_keys, cfg.seed)
                f = figures(agg, items, truth, None, clusters)
                f["cpu_s"] = round(timings.get(m, 0.0) + shared / max(len(per_item), 1), 2)
                res["methods"][m] = f
        finally:
            idx.close()
    if name == "cluster" and single_checks:
        res["single_poison"] = single_poison_checks(cfg_path, truth, single_checks)
    if lds is not None and name != "null" and rep is not None and rep.get("verdict") == "attributed":
        res["lds"] = lds_figures(cfg_path, default, [m for m in preconds if m in PRECONDITIONERS], *lds)
    res["cpu_s"] = round(time.process_time() - t_run, 2)
    return res


def _clusters_for(scores, s, idx, row_keys, seed):
    try:
        from gradian.explain.clusters import score_clusters
        from gradian.store.rows import RowSource
    except ImportError:
        return None
    return score_clusters(scores, [e.plain_text() for e in s.examples], seed=seed,
                          gradients=RowSource(index=idx, row_keys=row_keys))["clusters"]


def lds_figures(cfg_path: Path, default: str, preconds: list[str], subsets: int, loo: int) -> dict:
    """`gradian fidelity` on the default's run: LDS (leave-5%-out, `subsets` retrains) and leave-one-out Pearson
    (`loo` rows per group) of every preconditioner, of the optimizer-aware scores (the adapter's trajectory is
    recorded), and the truth oracle's LDS."""
    from gradian.config import load_config
    from gradian.validate.fidelity import run_fidelity

    cfg = load_config(cfg_path, [f"output=out-{default}"])
    shutil.copyfile(cfg_path.parent / "truth.json", cfg.output_dir / "truth.json")  # where the oracle reads it
    t0 = time.process_time()
    res = run_fidelity(cfg, loo=loo, subsets=subsets, preconditioners=[default] + [p for p in preconds if p != default])
    lds_by = (res.get("lds") or {}).get("by_preconditioner") or {}
    loo_by = (res.get("loo") or {}).get("by_preconditioner") or {}
    return {"oracle": (res.get("lds") or {}).get("truth_oracle"), "subsets": subsets, "loo_rows": loo,
            "lds": {m: v.get("lds") for m, v in lds_by.items()},
            "loo_pearson": {m: v.get("pearson") for m, v in loo_by.items()},
            "retrains": res["timings"]["retrains"], "cpu_s": round(time.process_time() - t0, 1)}


def single_poison_checks(cfg_path: Path, truth: dict, n: int) -> list[dict]:
    """Retrain with all but one poison zero-weighted: does that one row alone flip the target items?"""
    from gradian.pipeline import evaluate
    from gradian.setup.session import open_session
    from gradian.config import load_config

    out = []
    poisons = list(truth["cluster"])
    keep_list = [poisons[int(round(i * (len(poisons) - 1) / max(n - 1, 1)))] for i in range(n)]
    for keep in keep_list:
        name = f"adapter-single-{keep}"
        ensure_adapter(cfg_path, adapter=name, exclude=[p for p in poisons if p != keep])
        cfg = load_config(cfg_path, [f"model.adapter={name}", f"output=out-single-{keep}"])
        s = open_session(cfg)
        cap = evaluate(s)
        tg = truth["target_eval_items"]
        out.append({"kept": keep, "tuned_target": mean([cap.tuned_scores[i] for i in tg]),
                    "base_target": mean([cap.base_scores[i] for i in tg]), "significant": bool(cap.significant),
                    "delta": cap.delta})
    return out


# ------------------------------------------------------------------------------------------------ summary
def summarize(runs: list[dict], methods: list[str]) -> dict:
    by: dict[str, dict] = {}
    for r in runs:
        by.setdefault(r["scenario"], []).append(r)
    out: dict[str, Any] = {}
    keys = ["auprc", "recall_at_k", "recall_at_10", "top1", "top5", "span", "cluster", "cluster_jaccard",
            "top1_planted", "accused", "accused_planted", "planted_count", "cpu_s"]
    for name, rs in by.items():
        ms: dict[str, Any] = {}
        for m in methods:
            fs = [r["methods"][m] for r in rs if m in r["methods"] and "error" not in r["methods"][m]]
            if not fs:
                continue
            agg = {k: mean([f.get(k) for f in fs]) for k in keys}
            agg["seeds"] = len(fs)
            ratios = [f["accused"] / f["planted_count"] for f in fs if f.get("accused") is not None
                      and f.get("planted_count")]
            if ratios:
                agg["accused_ratio_min"], agg["accused_ratio_max"] = min(ratios), max(ratios)
            if any(f.get("accused") is not None for f in fs):
                agg["accused_max"] = max(f.get("accused") or 0 for f in fs)
            agg["failing_target_items"] = int(sum(f.get("failing_target_items", 0) for f in fs))
            agg["verdicts"] = [f.get("verdict") for f in fs if "verdict" in f]
            if name == "null" and agg["verdicts"]:
                agg["declined"] = mean([v == "declined" for v in agg["verdicts"]])
            rp = {json.dumps(f.get("preconditioner_reported"), sort_keys=True) for f in fs
                  if "preconditioner_reported" in f}
            if rp:
                agg["preconditioner_reported"] = [json.loads(x) for x in sorted(rp)]
            ms[m] = agg
        out[name] = {
            "seeds": [r["seed"] for r in rs],
            "main_figure": MAIN_FIGURE.get(name),
            "recipe": rs[0].get("recipe"),
            "failure": {k: mean([(r.get("failure") or {}).get(k) for r in rs])
                        for k in ("base_target", "tuned_target", "base_control", "tuned_control", "delta")},
            "train_cpu_s": round(sum(r["train_cpu_s"] for r in rs), 2),
            "cpu_s": round(sum(r["cpu_s"] for r in rs), 2),
            "methods": ms,
        }
        lds_runs = [r["lds"] for r in rs if r.get("lds")]
        if lds_runs:
            ms_l = sorted({m for x in lds_runs for m in x["lds"]})
            out[name]["lds"] = {"oracle": mean([x["oracle"] for x in lds_runs]),
                                "lds": {m: mean([x["lds"].get(m) for x in lds_runs]) for m in ms_l},
                                "loo_pearson": {m: mean([x["loo_pearson"].get(m) for x in lds_runs]) for m in ms_l},
                                "seeds": len(lds_runs), "subsets": lds_runs[0]["subsets"]}
        if any("single_poison" in r for r in rs):
            sp = [x for r in rs for x in r.get("single_poison", [])]
            out[name]["single_poison"] = {"checks": len(sp),
                                          "flipped": sum(1 for x in sp if (x["tuned_target"] or 0) < 0.5),
                                          "tuned_target": mean([x["tuned_target"] for x in sp])}
    return out


def acceptance(summary: dict, default: str) -> list[dict]:
    def get(name, fig, method=default):
        return ((summary.get(name) or {}).get("methods") or {}).get(method, {}).get(fig)

    checks = []

    def add(cid, value, target, ok=None, note=""):
        if ok is None:
            ok = value is not None and value >= target
        checks.append({"id": cid, "value": value, "target": target, "pass": bool(ok) if value is not None else None,
                       "note": note})

    if "substitution" in summary:
        add("substitution.auprc", get("substitution", "auprc"), 0.95)
    if "conversation4" in summary:
        add("conversation4.top1", get("conversation4", "top1"), 0.9)
    if "buried" in summary:
        add("buried.top5", get("buried", "top5"), 0.9)
        add("buried.span", get("buried", "span"), 0.95)
    if "cluster" in summary:
        # (the 20 poisons are the only rows naming the target fact, so a poison is also the aggregate top-1 row)
        c, t1 = get("cluster", "cluster"), get("cluster", "top1_planted")
        add("cluster.passes", c, 1.0,
            note=f"cluster recovered in {_fmt(c)} of seeds; aggregate top-1 row is a poison in {_fmt(t1)} of seeds")
    if "null" in summary:
        add("null.declined", get("null", "declined"), 0.95)
        add("null.accused_zero", get("null", "accused_max"), 0, ok=get("null", "accused_max") == 0,
            note="accused rows on the null runs (every seed)")
    for name, s in summary.items():
        m = (s.get("methods") or {}).get(default) or {}
        lo, hi = m.get("accused_ratio_min"), m.get("accused_ratio_max")
        if name != "null" and lo is not None:
            add(f"{name}.accused_within_2x", lo, 0.5, ok=lo >= 0.5 and hi <= 2.0,
                note=f"accused / planted per seed in [{_fmt(lo)}, {_fmt(hi)}] (planted {_fmt(m.get('planted_count'))},"
                     f" accused {_fmt(m.get('accused'))} on average)")
        ld = s.get("lds")
        if ld and ld.get("oracle"):
            v = (ld["lds"] or {}).get(default)
            add(f"{name}.lds_vs_oracle", None if v is None else v / ld["oracle"], 0.9,
                note=f"LDS {_fmt(v)} vs truth oracle {_fmt(ld['oracle'])}")
            add(f"{name}.loo_pearson", (ld["loo_pearson"] or {}).get(default), 0.7)
    for name, s in summary.items():
        fig = MAIN_FIGURE.get(name)
        if fig in (None, "declined"):
            continue
        if fig == "cluster":
            fig = "auprc"  # baselines have no cluster test of their own; compare the poisons' AUPRC
        for m in [default] + CHECKPOINT_METHODS + OPTIMIZER_METHODS:
            g = get(name, fig, m)
            tag = "" if m == default else f"[{m}]"
            for b in BASELINE_METHODS:
                v = get(name, fig, b)
                if v is None or g is None:
                    continue
                # a tie at the ceiling (both perfect) is no loss: nothing can beat 1.0
                ceiling = min(g, v) >= 1.0 - 1e-9  # AUPRC 1 comes out as 0.9999999999999999
                checks.append({"id": f"{name}.{fig}{tag}.beats_{b}", "value": g, "target": v,
                               "pass": bool(g > v or ceiling),
                               "note": ("tie at the ceiling" if ceiling else "tie" if g == v else "")
                               + ("; not the default" if tag else "")})
    return checks


def _clean(o):
    """JSON-safe: NaN -> None, numpy scalars -> Python, recursively."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and o != o:
        return None
    return o


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"seed 0 of each scenario but buried, 4 null seeds, the cheaper methods: under "
                         f"{QUICK_BUDGET_S // 60} minutes on two cores from a fresh clone")
    ap.add_argument("--scenarios", default=None, help="comma-separated scenario names (default: all)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds for every scenario (default: per scenario)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods (default: every preconditioner and baseline; with --quick, "
                         "QUICK_METHODS)")
    ap.add_argument("--single-checks", type=int, default=None,
                    help="cluster scenario: retrain with one poison kept, N times per seed (default 1; 0 with --quick)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "fidelity"), help="run directories (adapters are reused)")
    ap.add_argument("--lds", type=int, default=0, metavar="SUBSETS",
                    help="also run `gradian fidelity` per scenario with SUBSETS leave-5%%-out retrains (and --loo rows "
                         "per group) for LDS, LOO Pearson and the truth oracle (default 0: off)")
    ap.add_argument("--loo", type=int, default=20, help="with --lds: leave-one-out rows per group (top, bottom, random)")
    ap.add_argument("--lds-scenarios", default="substitution,conversation4,conversation8,cluster,format",
                    help="with --lds: the scenarios to retrain (buried's 144 long documents take ~45 s per retrain)")
    ap.add_argument("--smoke", action="store_true",
                    help="--scenarios substitution --seeds 0 --methods diagonal,bm25 under bench/_smoke.py's work "
                         "directory: checks the harness (one training, one attribute, one baseline)")
    args = ap.parse_args(argv)
    if args.smoke:
        from _smoke import work_dir

        args.scenarios, args.seeds, args.methods = "substitution", "0", "diagonal,bm25"
        args.out, args.single_checks = str(work_dir("fidelity")), 0

    from gradian.demo.scenarios import SCENARIO_NAMES

    plan = dict(QUICK_SEEDS if args.quick else FULL_SEEDS)
    if args.scenarios:
        names = [x.strip() for x in args.scenarios.split(",") if x.strip()]
        bad = [n for n in names if n not in SCENARIO_NAMES]
        if bad:
            ap.error(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(SCENARIO_NAMES)}")
        plan = {n: plan.get(n, FULL_SEEDS[n][:1] if args.quick else FULL_SEEDS[n]) for n in names}
    if args.seeds:
        seeds = [int(x) for x in args.seeds.split(",")]
        plan = {n: seeds for n in plan}
    if args.methods:
        methods = [m.strip() for m in args.methods.split(",")]
    elif args.quick:
        methods = list(QUICK_METHODS)
    else:
        methods = PRECONDITIONERS + CHECKPOINT_METHODS + OPTIMIZER_METHODS + BASELINE_METHODS
    single = args.single_checks if args.single_checks is not None else (0 if args.quick else 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    default = default_preconditioner()

    t0, w0 = time.process_time(), time.time()
    runs = []
    for name, seeds in plan.items():
        for seed in seeds:
            log(f"[{time.time() - w0:6.0f}s] {name} seed {seed} ...")
            lds_arg = (args.lds, args.loo) if args.lds and name in args.lds_scenarios.split(",") else None
            r = run_scenario(name, seed, out, methods, single, lds_arg)
            runs.append(r)
            fl = r.get("failure") or {}
            log(f"         train {r['train_cpu_s']:.1f}s{' (reused, as recorded)' if r['adapter_reused'] else ''}; "
                f"target items "
                f"base {_fmt(fl.get('base_target'))} -> tuned {_fmt(fl.get('tuned_target'))}; "
                f"verdict {fl.get('verdict')}; run {r['cpu_s']:.1f} cpu s")
    summary = summarize(runs, methods)
    checks = acceptance(summary, default)

    # ---- tables
    print(table("failure shows (target items: base -> tuned exact match; controls)",
                ["scenario", "recipe (train.* over the demo recipe)", "seeds", "base", "tuned", "ctrl base",
                 "ctrl tuned", "train s"],
                [[n, json.dumps(s["recipe"]) if s["recipe"] else "{}", len(s["seeds"]), s["failure"]["base_target"],
                  s["failure"]["tuned_target"], s["failure"]["base_control"], s["failure"]["tuned_control"],
                  s["train_cpu_s"]] for n, s in summary.items()]))
    print()
    rows = []
    for n, s in summary.items():
        for m, f in s["methods"].items():
            label = m + (" *" if m == default else "")
            rows.append([n, label, f["seeds"], f["failing_target_items"], f.get("auprc"), f.get("recall_at_k"),
                         f.get("top1"), f.get("top5"), f.get("span"), f.get("cluster"), f.get("declined"),
                         f.get("accused"), f.get("planted_count"), f.get("cpu_s")])
    print(table(f"fidelity per scenario and method (* = default preconditioner '{default}'; means over seeds)",
                ["scenario", "method", "seeds", "items", "auprc", "r@k", "top1", "top5", "span", "cluster",
                 "declined", "accused", "planted", "cpu_s"], rows))
    lds_rows = []
    for n, s in summary.items():
        ld = s.get("lds")
        if not ld:
            continue
        for m in sorted(ld["lds"], key=lambda x: (x != default, x)):
            v, o = ld["lds"][m], ld["oracle"]
            lds_rows.append([n, m + (" *" if m == default else "") + (" (optimizer-aware)" if m == "adamw" else ""),
                             ld["seeds"], ld["loo_pearson"].get(m), v, o, None if (v is None or not o) else v / o])
    if lds_rows:
        print()
        print(table("LDS (leave-5%-out retrains) and leave-one-out Pearson per scenario, against the truth oracle "
                    "(a predictor that knows which planted row causes which item)",
                    ["scenario", "method", "seeds", "LOO Pearson", "LDS", "oracle LDS", "LDS / oracle"], lds_rows))
    if "cluster" in summary:
        c = summary["cluster"]
        d = c["methods"].get(default, {})
        print()
        print(f"cluster: recovered {_fmt(d.get('cluster'))}, Jaccard {_fmt(d.get('cluster_jaccard'))}, aggregate "
              f"top-1 row a poison in {_fmt(d.get('top1_planted'))} of seeds; single-poison retrains: "
              f"{json.dumps(c.get('single_poison', 'not run'))}")
    print()
    print(table("acceptance", ["check", "value", "target", "pass", "note"],
                [[c["id"], c["value"], c["target"], c["pass"], c["note"]] for c in checks]))
    cpu, wall = time.process_time() - t0, time.time() - w0
    print(f"\ntotal: {cpu:.0f} CPU s, {wall:.0f} s wall; runs in {out}")
    budget = QUICK_BUDGET_S if args.quick and not (args.scenarios or args.seeds or args.methods) else None
    if budget is not None and wall > budget:
        log(f"--quick took {wall:.0f} s wall, over its budget of {budget} s (bench/README.md)")
    keep = ("auprc", "recall_at_k", "top1", "top5", "span", "cluster", "cluster_q", "top1_planted", "verdict",
            "failing_target_items", "cpu_s", "error")
    compact = [{"scenario": r["scenario"], "seed": r["seed"], "train_s": r["train_cpu_s"],
                "adapter_reused": r["adapter_reused"], "failure": r.get("failure"),
                "single_poison": r.get("single_poison"),
                "methods": {m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in f.items() if k in keep}
                            for m, f in r["methods"].items()}} for r in runs]
    result = {"bench": "fidelity", "schema": "gradian.bench.fidelity/1", "quick": bool(args.quick), "smoke": args.smoke,
              "default_preconditioner": default, "scenarios": summary, "acceptance": checks, "runs": compact,
              "cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "budget_wall_s": budget,
              "within_budget": None if budget is None else wall <= budget, "torch": torch.__version__}
    print(json.dumps(_clean(result), allow_nan=False, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
