"""Does an AdamW-aware first-order predictor beat the default scores on LOO and LDS? (a measurement, not a feature)

    .venv/bin/gradian fidelity runs/demo/gradian.yaml              # first: the retrains this compares against
    .venv/bin/python bench/optimizer_aware.py runs/demo/gradian.yaml [--set output=...]
    .venv/bin/python bench/optimizer_aware.py --smoke   # bench/_smoke.py's tiny scenario, after a fidelity of 1 LOO
                                                        # row per group and 2 LDS subsets (make bench-smoke)

Removing row z from a Gradian-recipe run changes the (clipped) batch gradient of each step t that holds it by
dg_t = -c_t g_z / n_t (c_t the clip factor, n_t the batch's supervised tokens). To first order, and without
propagating through later curvature, AdamW's later updates u_s = -lr m_s / sqrt(v_s) (bias-corrected) change by

    du_s = -lr (1-b1) b1^(s-t) / (1-b1^s) dg_t / sqrt(v_s)                    (the momentum term: influence)
           - 1/2 u_s (1-b2) b2^(s-t) / (1-b2^s) * 2 g_t dg_t / v_s           (the second-moment coupling term)

so the predicted change of a query is -q_hat . sum_s du_s. The second term is what plain influence misses: removing a
row lowers v where it had large gradients, so every other row's step there grows (on the demo, dropping one planted
row makes another planted row's failure worse, which first-order scores call the opposite). The replay records u_s,
v_s, g_t and c_t; per-example gradients g_z at step t are taken exact at the start of t's epoch (the seeded LoRA init
for epoch 1, then the replayed epoch checkpoints of `gradian.checkpoints`). Exact gradients: tiny models only.

Prints LOO Pearson / LDS of: the default scores (as `gradian fidelity` computes them), the momentum term alone, and
both terms; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

B1, B2, EPS = 0.9, 0.999, 1e-8


def replay_recording(cfg, recipe, sites_order):
    """Retrain with the recipe, recording per step: update u, bias-corrected v, clipped batch grad g, clip factor."""
    import gradian.training.loop as train_mod

    rec: dict = {"u": [], "v": [], "g": [], "c": []}
    orig_clip = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm, *a, **kw):
        n = orig_clip(params, max_norm, *a, **kw)
        rec["c"].append(min(1.0, float(max_norm) / (float(n) + 1e-6)))
        return n

    class Recording(torch.optim.AdamW):
        def __init__(self, params, **kw):
            params = list(params)
            super().__init__(params, **kw)
            rec["params"] = params

        def step(self, *a, **kw):
            ps = self.param_groups[0]["params"]
            before = [p.detach().clone() for p in ps]
            g = [p.grad.detach().clone() for p in ps]
            out = super().step(*a, **kw)
            s = float(self.state[ps[0]]["step"])
            rec["u"].append([p.detach() - b for p, b in zip(ps, before)])
            rec["v"].append([self.state[p]["exp_avg_sq"].detach() / (1 - B2 ** s) for p in ps])
            rec["g"].append(g)
            return out

    saved = torch.optim.AdamW, torch.nn.utils.clip_grad_norm_
    torch.optim.AdamW, torch.nn.utils.clip_grad_norm_ = Recording, clip
    try:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            train_mod.train_adapter(cfg, out_dir=Path(d) / "adapter", recipe=recipe, progress=False)
    finally:
        torch.optim.AdamW, torch.nn.utils.clip_grad_norm_ = saved
    if not rec["c"]:  # no clipping in the recipe
        rec["c"] = [1.0] * len(rec["u"])
    params = rec["params"]
    order = sites_order(params)

    def cat(ts):
        return torch.cat([ts[k].flatten() for k in order]).numpy().astype(np.float32)

    return (np.stack([cat(x) for x in rec["u"]]), np.stack([cat(x) for x in rec["v"]]),
            np.stack([cat(x) for x in rec["g"]]), np.asarray(rec["c"]))


def smoke_run() -> str:
    """bench/_smoke.py's tiny run with its report in opt-out/ and a fidelity.json beside it; its config path."""
    import shutil

    from _smoke import REPORT_DIR, tiny_run

    from gradian import api

    run = tiny_run()
    out = run / "opt-out"
    if not (out / "fidelity.json").exists():
        out.mkdir(exist_ok=True)
        for f in ("report.json", "scores.npy", "scores_total.npy"):
            shutil.copy2(run / REPORT_DIR / f, out / f)
        api.fidelity(api.load_config(run / "gradian.yaml", ["output=opt-out"]), loo=1, subsets=2)
    return str(run / "gradian.yaml")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--smoke", action="store_true",
                    help="on bench/_smoke.py's tiny scenario (its report copied to opt-out/, `gradian fidelity --loo 1 "
                         "--subsets 2` run there first): checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.config, args.overrides = smoke_run(), ["output=opt-out"]
    if not args.config:
        ap.error("give a config (or --smoke)")

    from peft import LoraConfig, get_peft_model

    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.attribution.checkpoints import replayed_adapters
    from gradian.config import load_config
    from gradian.setup.batches import collate
    from gradian.setup.session import open_session
    from gradian.report.read import load_report
    from gradian.validate.fidelity import correlations as _corr, lds, report_queries as _query_items, scores_with
    from gradian.setup.model import load_base
    from gradian.projection.projector import Projector
    from gradian.attribution.queries import query_vectors
    from gradian.runtime import seed_everything
    from gradian.training.loop import data_order
    from gradian.training.recipe import load_recipe

    cfg = load_config(args.config, args.overrides)
    fid_path = cfg.output_dir / "fidelity.json"
    if not fid_path.exists():
        sys.exit(f"{fid_path}: run `gradian fidelity {args.config}` first")
    fid = json.loads(fid_path.read_text())
    qitems, direction = _query_items(load_report(cfg.output_dir))
    recipe, _ = load_recipe(cfg)
    hp = recipe.hp
    E, B, lr, seed = int(hp["epochs"]), int(hp["batch_size"]), float(hp["learning_rate"]), int(recipe.seed)
    if direction != "regression":
        sys.exit("this measurement assumes a regression (the demo scenarios)")

    s = open_session(cfg)
    n = len(s.examples)

    def sites_order(params):
        order = []
        for st in s.sites:
            for w in (st.A.weight.detach(), st.B.weight.detach()):
                j = [k for k, p in enumerate(params) if p.shape == w.shape and torch.equal(p.detach(), w)]
                if len(j) != 1:
                    raise RuntimeError(f"{st.name}: the replay does not reproduce the adapter")
                order.append(j[0])
        return order

    U, V, Gt, c = replay_recording(cfg, recipe, sites_order)
    T = U.shape[0]
    exact = GradientCapture(s.model, s.sites, Projector(site_shapes(s.sites)), chunk=cfg.grads.loss_chunk_tokens)
    Q = query_vectors(exact, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=cfg.grads.max_seq_length,
                      batch_size=cfg.grads.batch_size).numpy().astype(np.float64)
    qh = Q / np.linalg.norm(Q, axis=1, keepdims=True)

    # epoch start states: the seeded LoRA init, then the replayed checkpoints of epochs 1..E-1
    seed_everything(seed)
    base = load_base(cfg)
    torch.manual_seed(seed)
    init = get_peft_model(base, LoraConfig(r=hp["lora_r"], lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"],
                                           target_modules=hp["target_modules"], task_type="CAUSAL_LM"))
    import atexit
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="gradian-optimizer-aware-"))
    atexit.register(shutil.rmtree, tmp, True)  # the epoch-start adapters, gone when the process ends
    init.save_pretrained(tmp / "init")
    del init, base
    ck, epochs = replayed_adapters(cfg, s.adapter_path, E, progress=False)
    starts = [tmp / "init"] + [p for p, e in zip(ck, epochs) if e < E]
    if len(starts) != E:
        sys.exit(f"expected {E} epoch start states, got {len(starts)}")
    pad = s.tokenizer.pad_token_id
    toks = s.toks
    ntok = np.array([sum(t.supervised[1:]) for t in toks], dtype=np.float64)
    G_at = []
    for p in starts:
        c2 = cfg.model_copy(deep=True)
        c2.root = cfg.root
        c2.model.adapter = str(p)
        sub = open_session(c2)
        cap = GradientCapture(sub.model, sub.sites, Projector(site_shapes(sub.sites)), chunk=cfg.grads.loss_chunk_tokens)
        rows = []
        for i in range(0, n, cfg.grads.batch_size):
            ids, attn, sup = collate(toks[i : i + cfg.grads.batch_size], pad)
            rows.append(cap.vectors(ids, attn, sup)[0].detach().numpy())
        G_at.append(np.concatenate(rows).astype(np.float64))
        del sub, cap

    # K1_t = sum_{s>=t} (1-b1) b1^(s-t) / (1-b1^s) / sqrt(v_s);  K2_t = sum_{s>=t} u_s (1-b2) b2^(s-t) / ((1-b2^s) v_s)
    sq = np.sqrt(V.astype(np.float64)) + EPS
    K1, K2 = np.zeros_like(U, dtype=np.float64), np.zeros_like(U, dtype=np.float64)
    a1 = np.zeros(U.shape[1])
    a2 = np.zeros(U.shape[1])
    for t in range(T - 1, -1, -1):
        st = t + 1
        a1 = (1 - B1) / (1 - B1 ** st) / sq[t] + B1 * a1
        a2 = U[t] * (1 - B2) / ((1 - B2 ** st) * (V[t] + EPS ** 2)) + B2 * a2
        K1[t], K2[t] = a1, a2
    batches = [(e, b) for e, ep in enumerate(data_order(n, E, B, seed)) for b in ep]
    if len(batches) != T:
        sys.exit(f"{len(batches)} batches but {T} recorded steps (a fully excluded batch was skipped?)")
    D1 = np.zeros((Q.shape[0], n))
    D2 = np.zeros((Q.shape[0], n))
    for t, (e, b) in enumerate(batches):
        G = G_at[e]
        nt = max(ntok[b].sum(), 1.0)
        q1, q2 = qh * K1[t], qh * (Gt[t] * K2[t])
        for i in b:
            dg = -c[t] * G[i] / nt
            D1[:, i] += lr * (q1 @ dg)
            D2[:, i] += q2 @ dg

    P0 = scores_with(s, qitems, direction)
    A = np.array(fid["lds"]["actual"])
    subs = fid["lds"]["removed"]
    loo = fid["loo"]["rows"]

    def figures(P):
        agg = P.mean(0)
        lo = _corr([agg[x["position"]] for x in loo], [x["actual"] for x in loo])
        return {"loo_pearson": lo["pearson"], "loo_spearman": lo["spearman"], "lds": lds(P, subs, A)["lds"]}

    res = {"default (" + cfg.attribution.preconditioner + ")": figures(P0), "adam momentum term": figures(D1),
           "adam momentum + second-moment coupling": figures(D1 + D2)}
    print(f"{'predictor':42s} {'LOO Pearson':>12s} {'LOO Spearman':>13s} {'LDS':>7s}")
    for k, v in res.items():
        print(f"{k:42s} {v['loo_pearson']:12.3f} {v['loo_spearman']:13.3f} {v['lds']:7.3f}")
    oracle = (fid.get("lds") or {}).get("truth_oracle")
    if oracle is not None:
        print(f"{'truth oracle (fidelity.json)':42s} {'':12s} {'':13s} {oracle:7.3f}")
    print(json.dumps({"bench": "optimizer_aware", "smoke": args.smoke, "config": args.config, "steps": T, "epochs": E,
                      "truth_oracle": oracle, "predictors": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
