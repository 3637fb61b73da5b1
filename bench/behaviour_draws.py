"""How many answers, at which temperature, a behaviour query needs: the sampling noise of the query, measured over
many draws from one fine-tune.

    .venv/bin/python bench/behaviour_draws.py extract RUN [--per-item 48] [--temperatures 1.0,0.7]
    .venv/bin/python bench/behaviour_draws.py analyse RUN
    .venv/bin/python bench/behaviour_draws.py --smoke      # extract (8 answers, one temperature) and analyse on
                                                           # bench/_smoke.py's tiny scenario

RUN is a fine-tuned real scenario with a behaviour metric (`bench/real_models.py --work DIR --scenarios NAME`).
`extract` samples `--per-item` answers per failing item from the fine-tune at each temperature (seeded; the sampler
of `gradian.attribution.behaviour`), and at the earliest checkpoint (the defaults' adapter state) computes the exact
LoRA gradient of every training row and of every sampled answer; it saves only what scoring needs: per item the
answers' inner products with every row and with each other in the rows' diagonal metric (their second moments,
damped by 0.1 x their mean), and the rows' norms, in RUN/draws/. `analyse` then scores, for n = 8, 16, 32 and all,
every disjoint draw of n answers out of the `--per-item` (the query: the mean gradient of the draw's failing answers;
an item with none, the greedy answer), at unit rows and unit queries, mean over items, and prints per (temperature,
n) the mean and worst AUPRC over the draws, how many draws are perfect, and the worst planted rank of each.
Research tool: the defaults it measured are `attribution.behaviour_samples` and `attribution.behaviour_temperature`.
"""

from __future__ import annotations

import argparse
import json
import os
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


def extract(run: Path, per_item: int, temperatures: list[float]) -> None:
    from gradian.attribution.behaviour import sample_answers
    from gradian.attribution.queries import query_items, select_failing
    from gradian.config import load_config
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.pipeline import evaluate
    from gradian.projection import Projector
    from gradian.setup.batches import batches
    from gradian.setup.session import open_session
    from gradian.setup.tokenize import eval_answer_example, tokenize_example

    out = run / "draws"
    out.mkdir(exist_ok=True)
    cfg = load_config(run / "gradian.yaml", ["output=draws-out"])
    s = open_session(cfg)
    L, bs = cfg.grads.max_seq_length, cfg.grads.batch_size
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing, "contrastive", metric=cfg.evaluation.metric, direction=direction)
    by = {it.position: it for it in s.eval_items}
    t0 = time.process_time()
    samples = {T: sample_answers(s.model, s.tokenizer, s.eval_items, qitems, s.metric, chat=s.chat, n=per_item,
                                 max_new_tokens=cfg.evaluation.max_new_tokens, seed=12345, one_line=s.one_line,
                                 temperature=T) for T in temperatures}
    print(f"sampled {per_item} x {len(qitems)} items x {len(temperatures)} temperatures "
          f"({time.process_time() - t0:.0f} CPU s)", flush=True)
    from gradian.attribution.checkpoints import saved_adapters, without_final

    # the earliest saved state: a Trainer's checkpoint-<step> or `gradian train`'s epoch-<k>
    cks = without_final(saved_adapters(str(run / "adapter")), str(run / "adapter"))
    with s.checkpoint(str(cks[0].resolve()), "draws") as view:
        capture = GradientCapture(view.model, view.sites, Projector(site_shapes(view.sites)))

        def grads(toks):
            res = np.zeros((len(toks), capture.dim), dtype=np.float32)
            for part, ids, attn, sup in batches(toks, range(len(toks)), bs, s.pad_id):
                res[part] = capture.vectors(ids, attn, sup)[0].numpy()
            return res

        G = grads(view.toks)
        m = np.square(G).mean(0, dtype=np.float64)
        d = (1.0 / (m + 0.1 * m.mean())).astype(np.float32)
        gn = np.sqrt((np.square(G) * d).sum(1, dtype=np.float64))
        greedy = grads([tokenize_example(s.tokenizer, eval_answer_example(by[q.item], q.generated, s.chat), L)
                        for q in qitems]) * d
        np.savez(out / "rows.npz", gn=gn, greedyA=greedy @ G.T, greedyN=np.sqrt((greedy * (greedy / d)).sum(1)))
        meta = {"items": [q.item for q in qitems], "temperatures": temperatures}
        for T in temperatures:
            for j, q in enumerate(qitems):
                ss = samples[T][j]
                S = grads([tokenize_example(s.tokenizer, eval_answer_example(by[q.item], x.text, s.chat), L)
                           for x in ss])
                SM = S * d
                np.savez(out / f"T{T}_q{j}.npz", A=SM @ G.T, K=SM @ S.T, passes=np.array([x.passes for x in ss]),
                         empty=np.array([not x.text.strip() for x in ss]))
            print(f"temperature {T}: gradients ({time.process_time() - t0:.0f} CPU s)", flush=True)
    (out / "meta.json").write_text(json.dumps(meta))


def analyse(run: Path) -> list[dict]:
    from gradian.attribution.scoring import auprc

    out = run / "draws"
    meta = json.loads((out / "meta.json").read_text())
    planted = json.loads((run / "truth.json").read_text())["planted"]
    rows = np.load(out / "rows.npz")
    gn = rows["gn"]
    print("| scenario | temperature | n | draws | AUPRC mean | AUPRC worst | perfect draws | worst planted rank per draw |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for T in meta["temperatures"]:
        data = [np.load(out / f"T{T}_q{j}.npz") for j in range(len(meta["items"]))]
        N = len(data[0]["passes"])
        for n in sorted({x for x in (8, 16, 32) if x < N} | {N}):
            res = []
            for start in range(0, N - n + 1, n):
                per = []
                for j, dd in enumerate(data):
                    fail = [i for i in range(start, start + n) if not dd["passes"][i] and not dd["empty"][i]]
                    if not fail:  # the pipeline's fallback: the greedy answer alone
                        a, norm = rows["greedyA"][j], rows["greedyN"][j]
                    else:
                        w = np.zeros(N)
                        w[fail] = 1.0
                        a, norm = w @ dd["A"], np.sqrt(max(float(w @ dd["K"] @ w), 1e-30))
                    per.append(a / norm / gn)
                sc = np.mean(per, 0)
                order = np.argsort(-sc, kind="stable")
                res.append((auprc(sc, planted), max(int(np.where(order == p)[0][0]) + 1 for p in planted)))
            a = [r[0] for r in res]
            print(f"| {run.name} | {T} | {n} | {len(res)} | {np.mean(a):.3f} | {np.min(a):.3f} | "
                  f"{sum(x >= 0.9999 for x in a)}/{len(a)} | {[r[1] for r in res]} |")
            rows.append({"temperature": T, "n": n, "draws": len(res), "auprc_mean": float(np.mean(a)),
                         "auprc_worst": float(np.min(a)), "worst_planted_rank": [r[1] for r in res]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", choices=["extract", "analyse"])
    ap.add_argument("run", nargs="?", type=Path)
    ap.add_argument("--per-item", type=int, default=48)
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--smoke", action="store_true",
                    help="extract (--per-item 8 --temperatures 1.0) then analyse on bench/_smoke.py's tiny scenario")
    a = ap.parse_args()
    if a.smoke:
        from _smoke import tiny_run

        run = tiny_run()
        extract(run, 8, [1.0])
        rows = analyse(run)
    elif a.what is None or a.run is None:
        ap.error("give WHAT and RUN (or --smoke)")
    elif a.what == "extract":
        extract(a.run, a.per_item, [float(x) for x in a.temperatures.split(",")])
        return
    else:
        rows = analyse(a.run)
    print(json.dumps({"bench": "behaviour_draws", "smoke": a.smoke, "rows": rows}))


if __name__ == "__main__":
    main()
