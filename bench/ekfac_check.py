"""Gradian's `ekfac` preconditioner against kronfluence's EK-FAC, at matched settings, on the demo.

kronfluence is installed for this bench only, into the checkout's ignored `.bench-env/kronfluence` (never into
.venv: its torchvision requirement would pull a torchvision that breaks transformers, so it goes in without
dependencies; kronfluence does not import torchvision on this path), and this script puts that directory on its own
path:

    make bench-ekfac      # = make bench-env (kronfluence 1.0.1, einops 0.8.1, einconv 0.1.0, opt-einsum 3.4.0 into
                          #   .bench-env/kronfluence) + GRADIAN_THREADS=1 .venv/bin/python bench/ekfac_check.py

From a fresh clone with a fresh GRADIAN_CACHE (2026-12-02, two cores, one thread): `make bench-env` 9 s, then the check
153 CPU s, 2 min 36 s wall (building the tiny base and training the demo are most of it); 32 CPU s, 33 s wall once
the demo is trained (reused from runs/ekfac-check).

(accelerate, safetensors and tqdm, which kronfluence also imports, come from .venv: `make venv` installs them.) The
scratch directory defaults to runs/ekfac-check (the trained demo is kept there and reused).

    .venv/bin/python bench/ekfac_check.py --smoke   # bench/_smoke.py's tiny scenario instead of the demo (seconds);
                                                    # without kronfluence, Gradian's half alone, and it says so

Matched settings: the demo's trained LoRA (`gradian demo`'s scenario and recipe), the same tracked modules (every
LoRA A and B Linear, each its own EK-FAC block in both), the same loss (each row's summed supervised-token loss,
`grads.objectives.per_example_loss`, for the factors, the eigenvalue correction and the training gradients: the
empirical Fisher, kronfluence's `use_empirical_fisher=True`), the same tokens (the attention mask), the same damping
rule (kronfluence's heuristic `damping_factor=None`: 0.1 x the mean corrected eigenvalue per module, Gradian's
default) and the same data (the 300 training rows; the failing items' contrastive queries). kronfluence computes one
score per query *row*: an item's contrastive query loss(expected) - loss(generated) is two rows, and its score is
the difference of theirs (scores are linear in the query gradient). Gradian reports -<H^-1 q, g> / |H^-1 q| (harm
sign, unit query), kronfluence <H^-1 q, g>: per item the two differ by a negative factor, so the figures are the
Spearman and Pearson of Gradian's scores against minus kronfluence's, per failing item (mean and minimum), and over
all (item, row) pairs once each item's scores are divided by their standard deviation.

Last line: one JSON object (`"schema": "gradian.bench.ekfac_check/1"`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
# kronfluence and its pure-Python dependencies, as `make bench-env` installs them (after .venv's own packages)
KRON_SITE = ROOT / ".bench-env" / "kronfluence"
if KRON_SITE.is_dir():
    sys.path.append(str(KRON_SITE))


def trained_demo(run: Path) -> Path:
    """The demo scenario in `run` with its LoRA trained by `gradian train` (reused when already there)."""
    from gradian.config import load_config
    from gradian.demo.run import prepare_demo
    from gradian.training.loop import train_adapter

    cfg_path = prepare_demo(run, progress=False)
    if not (run / "adapter" / "adapter_model.safetensors").exists():
        train_adapter(load_config(cfg_path), progress=False)
    return cfg_path


def kron_scores(cfg, s, qitems, work: Path, batch_size: int) -> tuple[np.ndarray, dict]:
    """kronfluence's EK-FAC pairwise scores [Q, N] of the contrastive queries (each item's expected row minus its
    generated row), and its CPU seconds (factors, scores)."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from kronfluence.utils.dataset import DataLoaderKwargs

    from gradian.attribution.queries import query_rows
    from gradian.grads.objectives import per_example_loss
    from gradian.setup.batches import collate
    from gradian.setup.model import load_model

    model = load_model(cfg, s.adapter_path)
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and (n.endswith("lora_A.default") or n.endswith("lora_B.default"))]
    if len(names) != 2 * len(s.sites):
        raise SystemExit(f"found {len(names)} LoRA A/B Linear modules, expected {2 * len(s.sites)}")
    pad = s.pad_id
    chunk = cfg.grads.loss_chunk_tokens

    class Rows(torch.utils.data.Dataset):
        """Tokenized rows with the sign their query gives them (+1 for training rows)."""

        def __init__(self, toks, signs=None):
            self.items = [(t, 1.0 if signs is None else float(signs[i])) for i, t in enumerate(toks)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    def collate_fn(items):  # Gradian's right-padded batches (setup.batches.collate), for both loaders
        ids, attn, sup = collate([t for t, _ in items], pad)
        return ids, attn, sup, torch.tensor([x for _, x in items])

    class GradianTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            ids, attn, sup, _ = batch
            # the empirical Fisher (use_empirical_fisher=True): the rows' own targets, never sampled ones
            return per_example_loss(model, ids, attn, sup, chunk=chunk).sum()

        def compute_measurement(self, batch, model):
            ids, attn, sup, sign = batch
            return (per_example_loss(model, ids, attn, sup, chunk=chunk) * sign).sum()

        def get_influence_tracked_modules(self):
            return names

        def get_attention_mask(self, batch):
            return batch[1]

    rows, sign, owner, margin = query_rows(s.tokenizer, s.eval_items, qitems, chat=s.chat,
                                           max_len=cfg.grads.max_seq_length)
    if margin:
        raise SystemExit("margin queries are not part of this check (the demo's are contrastive)")
    train_ds, query_ds = Rows(s.toks), Rows(rows, sign)
    task = GradianTask()
    model = prepare_model(model, task)
    analyzer = Analyzer("gradian-ekfac-check", model, task, cpu=True, output_dir=str(work), disable_tqdm=True)
    fargs = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
    sargs = ScoreArguments(damping_factor=None)
    t0 = time.process_time()
    analyzer.fit_all_factors("ekfac", train_ds, per_device_batch_size=batch_size, factor_args=fargs,
                             dataloader_kwargs=DataLoaderKwargs(collate_fn=collate_fn),
                             overwrite_output_dir=True)
    t1 = time.process_time()
    analyzer.compute_pairwise_scores(
        "scores", "ekfac", query_ds, train_ds, per_device_query_batch_size=batch_size,
        per_device_train_batch_size=batch_size, score_args=sargs, overwrite_output_dir=True,
        dataloader_kwargs=DataLoaderKwargs(collate_fn=collate_fn))
    t2 = time.process_time()
    S = analyzer.load_pairwise_scores("scores")["all_modules"].double().numpy()  # [query rows, N]
    out = np.zeros((len(qitems), S.shape[1]))
    for j, q in enumerate(owner):
        out[q] += S[j]  # the sign is in the measurement
    return out, {"factors_cpu_s": round(t1 - t0, 2), "scores_cpu_s": round(t2 - t1, 2)}


def correlations(g: np.ndarray, k: np.ndarray) -> dict:
    from scipy.stats import pearsonr, spearmanr

    sp = [float(spearmanr(a, b)[0]) for a, b in zip(g, k)]
    pe = [float(pearsonr(a, b)[0]) for a, b in zip(g, k)]
    gz = (g / g.std(axis=1, keepdims=True)).ravel()
    kz = (k / k.std(axis=1, keepdims=True)).ravel()
    return {"spearman_mean": float(np.mean(sp)), "spearman_min": float(np.min(sp)), "pearson_mean": float(np.mean(pe)),
            "pearson_min": float(np.min(pe)), "pooled_spearman": float(spearmanr(gz, kz)[0]),
            "pooled_pearson": float(pearsonr(gz, kz)[0]), "items": len(sp)}


# ------------------------------------------------------------------------------------- real-shape memory
# SmolLM-135M's shape (random weights, built in the process: nothing downloaded): 30 layers, hidden 576, 9 heads and
# 3 KV heads, MLP 1536, vocabulary 49,152, tied embeddings; LoRA r 16 on all 7 projections (210 sites, 4.9M LoRA
# weights) with a non-zero B.
REAL_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def real_shape_probe(rows: int, tokens: int, memory_bytes: int, work: Path) -> dict:
    """One measurement (run in its own process): peak RSS after building the model, and after fitting EK-FAC over
    `rows` rows of `tokens` tokens (factors written beside a stand-in index directory and read back site by site
    to precondition 8 queries)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradian.attribution import ekfac
    from gradian.grads.layout import exact_widths, site_shapes
    from gradian.setup.model import lora_sites
    from gradian.setup.tokenize import Tokenized

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**REAL_SHAPE))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.eval()
    sites, _ = lora_sites(model, None)
    g = torch.Generator().manual_seed(1)
    toks = [Tokenized(torch.randint(5, REAL_SHAPE["vocab_size"], (tokens,), generator=g).tolist(),
                      [False] * (tokens // 2) + [True] * (tokens - tokens // 2), "") for _ in range(rows)]
    base_rss = _vm_hwm()
    # the reference: one exact capture pass over the same rows, what building an exact index peaks at
    from gradian.grads.capture import GradientCapture
    from gradian.setup.batches import batches

    cap = GradientCapture(model, sites)
    for _, ids, attn, sup in batches(toks, range(len(toks)), 4, 0):
        cap.vectors(ids, attn, sup)
    del cap
    capture_rss = _vm_hwm()
    t0 = time.process_time()
    grads = SimpleNamespace(model=model, sites=sites, toks=toks, batch_size=4, pad_id=0, chunk=1024)
    root = work / f"factors-{rows}-{memory_bytes}"
    shutil.rmtree(root, ignore_errors=True)
    pre = ekfac.fit_or_load(grads, None, damping=None, root=root, memory_bytes=memory_bytes)
    Q = np.random.default_rng(0).normal(size=(8, sum(exact_widths(site_shapes(sites))))).astype(np.float32)
    pre.apply(Q)
    cpu = time.process_time() - t0
    size = sum(p.stat().st_size for p in root.glob(f"{ekfac.FACTORS_PREFIX}*.safetensors"))
    shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "tokens_per_row": tokens, "memory_bytes": memory_bytes, "sites": len(sites),
            "lora_params": sum(s.numel for s in sites), "model_bytes": sum(p.numel() * 4 for p in model.parameters()),
            "peak_rss_model": base_rss, "peak_rss_capture": capture_rss, "peak_rss_ekfac": _vm_hwm(), "factor_file_bytes": size,
            "groups": pre.info["groups"], "model_passes": pre.info["model_passes"], "cpu_s": round(cpu, 1)}


def real_shape(work: Path, rows: list[int], tokens: int, budgets: list[int]) -> dict:
    """Each (rows, budget) probe in its own process, so every peak is its own."""
    import subprocess

    out = []
    for r in rows:
        for b in budgets:
            cmd = [sys.executable, __file__, "--_probe", json.dumps({"rows": r, "tokens": tokens, "memory_bytes": b,
                                                                       "work": str(work)})]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
            if res.returncode != 0:
                raise SystemExit(f"probe {r} rows, budget {b} failed:\n{res.stderr[-3000:]}")
            out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    gib = 1 << 30
    print(f"{'rows':>5s} {'budget GiB':>10s} {'groups':>6s} {'passes':>6s} {'peak model GB':>13s} "
          f"{'peak capture GB':>15s} {'peak ekfac GB':>13s} {'over capture GB':>15s} {'factors GB':>10s} "
          f"{'CPU s':>7s}")
    for x in out:
        print(f"{x['rows']:5d} {x['memory_bytes'] / gib:10.2f} {x['groups']:6d} {x['model_passes']:6d} "
              f"{x['peak_rss_model'] / 1e9:13.2f} {x['peak_rss_capture'] / 1e9:15.2f} "
              f"{x['peak_rss_ekfac'] / 1e9:13.2f} {(x['peak_rss_ekfac'] - x['peak_rss_capture']) / 1e9:15.2f} "
              f"{x['factor_file_bytes'] / 1e9:10.2f} {x['cpu_s']:7.1f}")
    return {"probes": out, "shape": REAL_SHAPE, "lora_r": 16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "ekfac-check"),
                    help="scratch directory (the trained demo is kept and reused there)")
    ap.add_argument("--real-shape", action="store_true",
                    help="instead: peak RSS of the EK-FAC fit on a SmolLM-135M-shaped model (random weights, LoRA r 16 "
                         "on all 7 projections) for 16 and 48 rows and two statistics budgets; kronfluence not needed")
    ap.add_argument("--smoke", action="store_true",
                    help="on bench/_smoke.py's tiny scenario (seconds); kronfluence's half only when it is installed")
    ap.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._probe:
        kw = json.loads(args._probe)
        print(json.dumps(real_shape_probe(kw["rows"], kw["tokens"], kw["memory_bytes"], Path(kw["work"]))))
        return 0
    if args.real_shape:
        res = real_shape(Path(args.work), [16, 48], 64, [2 << 30, 256 << 20])
        print(json.dumps({"bench": "ekfac_check", "schema": "gradian.bench.ekfac_check/1", "real_shape": res}))
        return 0
    kron = True
    try:
        import kronfluence  # noqa: F401
    except ImportError:
        if not args.smoke:
            sys.exit(f"kronfluence is not importable from {KRON_SITE.relative_to(ROOT)}: run `make bench-env` (or "
                     "`make bench-ekfac`, which runs this check after it) from the repository root")
        kron = False
        print(f"kronfluence is not importable from {KRON_SITE.relative_to(ROOT)} (`make bench-env`): this smoke run "
              "checks Gradian's half alone; kronfluence's scores and the comparison are skipped", file=sys.stderr)

    from gradian.attribution.queries import query_items, select_failing
    from gradian.config import load_config
    from gradian.pipeline import evaluate, index_stage, score_adapter
    from gradian.setup.session import open_session

    work = Path(args.work)
    if args.smoke:
        from _smoke import tiny_run, work_dir

        work = work_dir("ekfac_check")
        cfg = load_config(tiny_run() / "gradian.yaml", ["output=ekfac-out"])
    else:
        cfg = load_config(trained_demo(work / "demo"))
    s = open_session(cfg)
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing, "contrastive")
    ix = index_stage(s)
    try:
        # a fresh fit (not a cached one) so its time is measured
        from gradian.attribution.ekfac import clear_factors

        clear_factors(ix.index.root)
        t0 = time.process_time()
        # raw inner products, as kronfluence scores them: the default unit rows (a cosine in the preconditioner's
        # metric) would compare a different score, not the EK-FAC maths
        sc = score_adapter(s, ix, qitems, direction, preconditioner="ekfac", windows=False, unit_rows=False)
        t_g = time.process_time() - t0
        G = np.asarray(sc.scores.per_item, dtype=np.float64)
        t0 = time.process_time()
        sc_d = score_adapter(s, ix, qitems, direction, preconditioner="diagonal", windows=False, unit_rows=False)
        t_d = time.process_time() - t0
        D = np.asarray(sc_d.scores.per_item, dtype=np.float64)
        info = sc.basis.precond.describe()
    finally:
        ix.close()
    if not kron:
        res = {"bench": "ekfac_check", "schema": "gradian.bench.ekfac_check/1", "smoke": True,
               "kronfluence": "skipped: not installed (make bench-env)", "rows": len(s.toks), "items": len(qitems),
               "gradian_ekfac_vs_diagonal": correlations(G, D),
               "cpu_s": {"gradian_ekfac": round(t_g, 2), "gradian_diagonal": round(t_d, 2)},
               "gradian_factors": info["factors"]}
        print(f"gradian ekfac vs diagonal: Spearman mean {res['gradian_ekfac_vs_diagonal']['spearman_mean']:.4f}; "
              f"kronfluence skipped (not installed)")
        print(json.dumps(res, default=str))
        return 0
    kdir = work / "kronfluence"
    shutil.rmtree(kdir, ignore_errors=True)
    K, kt = kron_scores(cfg, s, qitems, kdir, cfg.grads.batch_size)
    res = {"bench": "ekfac_check", "smoke": args.smoke, "schema": "gradian.bench.ekfac_check/1", "rows": len(s.toks),
           "items": len(qitems),
           "sites": len(s.sites), "modules": 2 * len(s.sites), "lora_params": sum(x.numel for x in s.sites),
           "gradian_vs_kronfluence": correlations(G, -K),
           "diagonal_vs_kronfluence": correlations(D, -K),
           "cpu_s": {"gradian_ekfac": round(t_g, 2), "gradian_ekfac_fit": info["factors"].get("fit_seconds"),
                     "gradian_diagonal": round(t_d, 2), "kronfluence_factors": kt["factors_cpu_s"],
                     "kronfluence_scores": kt["scores_cpu_s"],
                     "kronfluence_total": round(kt["factors_cpu_s"] + kt["scores_cpu_s"], 2)},
           "gradian_factors": info["factors"], "torch": torch.__version__}
    c = res["gradian_vs_kronfluence"]
    print(f"{'':28s} {'Spearman mean':>14s} {'min':>7s} {'Pearson mean':>13s} {'min':>7s} {'pooled Sp.':>11s}")
    for name, key in (("gradian ekfac vs kronfluence", "gradian_vs_kronfluence"),
                      ("(diagonal vs kronfluence)", "diagonal_vs_kronfluence")):
        x = res[key]
        print(f"{name:28s} {x['spearman_mean']:14.4f} {x['spearman_min']:7.4f} {x['pearson_mean']:13.4f} "
              f"{x['pearson_min']:7.4f} {x['pooled_spearman']:11.4f}")
    t = res["cpu_s"]
    print(f"CPU s: gradian ekfac {t['gradian_ekfac']} (fit {t['gradian_ekfac_fit']}), kronfluence {t['kronfluence_total']} "
          f"(factors {t['kronfluence_factors']}, scores {t['kronfluence_scores']}); {res['items']} items x "
          f"{res['rows']} rows, {res['modules']} modules")
    res["meets"] = {"spearman_ge_0.99": c["spearman_mean"] >= 0.99}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
