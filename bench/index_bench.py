"""Index benchmark (a measurement, not a test): what building and scoring a gradient index costs, and how well
projected scores keep the exact ranking.

    .venv/bin/python bench/index_bench.py --quick      # about 4 CPU minutes, one thread (models cached: README)
    .venv/bin/python bench/index_bench.py              # more rows, widths, repetitions and loss chunks
    .venv/bin/python bench/index_bench.py --smoke      # every section at toy sizes, seconds (make bench-smoke)

Prints a table per section, then ONE JSON object as the last line (see bench/README.md for every field).
Everything runs on one CPU thread; CPU times are `time.process_time`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")

if __name__ == "__main__" and "--_loss-child" in sys.argv:
    # A process exec'd from the (large) benchmark starts with the benchmark's peak RSS in its ru_maxrss (Linux
    # carries the old address space's high-water mark across exec). A fork of this still small interpreter gets a
    # fresh account, so its ru_maxrss deltas measure the loss alone.
    _pid = os.fork()
    if _pid:
        os._exit(os.waitstatus_to_exitcode(os.waitpid(_pid, 0)[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

WIDTHS = [128, 256, 512, 1024, 2048, 4096, 8192]
from gradian.projection.auto import AUTO_WIDTH  # noqa: E402
KINDS = ["rademacher", "gaussian", "sjlt", "data-aware"]
TARGETS = {"overhead_ratio": 1.2, "top50_recall_reranked": 0.95, "spearman_top5pct_reranked": 0.95,
           "loss_peak_ratio": 0.15, "fp16_top50_recall": 1.0, "shape_overhead_default": 1.10}
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r))  # noqa: E731
    out = [f"== {title}", line(cells[0]), "  ".join("-" * x for x in w)] + [line(r) for r in cells[1:]]
    return "\n".join(out)


def _fmt(c) -> str:
    if isinstance(c, float):
        if c and abs(c) < 1e-3:
            return f"{c:.1e}"
        return f"{c:.3f}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


# ------------------------------------------------------------------------------------------------ scenario


def _fallback_scenario(world, run_dir: Path, seed: int) -> None:
    """train.jsonl (one chat row per fact, 10 facts planted with a wrong value), eval.jsonl, truth.json."""
    rng = random.Random(f"gradian-bench-{seed}")
    facts = world.fact_pairs()
    planted = set(rng.sample(range(len(facts)), 10))
    train, truth, evals = [], [], []
    for i, (e, a) in enumerate(facts):
        p = rng.randrange(world.n_phrasings)
        v = world.wrong_value(e, a, rng) if i in planted else world.value(e, a)
        if i in planted:
            truth.append(len(train))
            for q in [x for x in range(world.n_phrasings) if x != p][:2]:
                evals.append({"prompt": world.question(e, a, q), "answer": world.value(e, a)})
        train.append({"messages": [{"role": "user", "content": world.question(e, a, p)},
                                   {"role": "assistant", "content": v}]})
    for i in rng.sample([i for i in range(len(facts)) if i not in planted], 30):
        e, a = facts[i]
        evals.append({"prompt": world.question(e, a, 0), "answer": world.value(e, a)})
    (run_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (run_dir / "truth.json").write_text(json.dumps({"planted": truth, "source": "bench fallback scenario"}))


def prepare(work: Path, seed: int) -> tuple[Path, str]:
    """Tiny base (cached), scenario files, config and a trained LoRA adapter in work/run; (config path, source)."""
    from gradian.config import load_config
    from gradian.demo.run import write_demo_config
    from gradian.demo.tiny import TinySpec, build_tiny_base
    from gradian.demo.world import World
    from gradian.training.recipe import read_recipe
    from gradian.training.loop import train_adapter

    spec = TinySpec()
    base = build_tiny_base(spec, progress=False)
    world = World.generate(seed=spec.seed, n_entities=spec.n_entities)
    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        from gradian.demo.scenario import make_substitution_scenario, write_scenario

        write_scenario(make_substitution_scenario(world, seed=seed), run_dir)
        source = "gradian.demo.scenario.make_substitution_scenario"
    except ImportError:
        _fallback_scenario(world, run_dir, seed)
        source = "bench fallback scenario (gradian.demo.scenario missing)"
    cfg_path = write_demo_config(run_dir, base)
    cfg = load_config(cfg_path)
    from gradian.setup.records import dataset_fingerprint, load_train

    rec = read_recipe(run_dir / "adapter")
    fp = dataset_fingerprint(load_train(run_dir / "train.jsonl"))
    if rec is None or rec.dataset_fingerprint != fp or rec.base_fingerprint is None:
        log("training the scenario's LoRA adapter ...")
        train_adapter(cfg, progress=False)
    torch.set_num_threads(1)
    return cfg_path, source


def pool_examples(world, n_extra: int, start: int):
    """Extra training-shaped rows from the same world (every phrasing of every fact, then fact statements)."""
    from gradian.setup.records import Example

    out = []
    for e, a in world.fact_pairs():
        for p in range(world.n_phrasings):
            out.append({"messages": [{"role": "user", "content": world.question(e, a, p)},
                                     {"role": "assistant", "content": world.value(e, a)}]})
    for e, a in world.fact_pairs():
        for t in range(world.n_statement_templates):
            out.append({"text": world.statement(e, a, template=t)})
    random.Random("gradian-bench-pool").shuffle(out)
    return [Example(id=f"pool-{start + i:06d}", position=start + i, shape="messages" if "messages" in r else "text",
                    record=r) for i, r in enumerate(out[:n_extra])]


# ---------------------------------------------------------------------------------------------- gradients


def batches_of(toks, bs: int):
    order = sorted(range(len(toks)), key=lambda i: (len(toks[i].input_ids), i))
    return [order[s : s + bs] for s in range(0, len(order), bs)]


def exact_vectors(capture, toks, pad: int, bs: int) -> np.ndarray:
    from gradian.setup.batches import collate

    out = np.zeros((len(toks), capture.dim), dtype=np.float32)
    for batch in batches_of(toks, bs):
        ids, attn, sup = collate([toks[i] for i in batch], pad)
        vecs, _ = capture.vectors(ids, attn, sup)
        out[batch] = vecs.detach().numpy()
    return out


def split_sites(shapes, flat: torch.Tensor):
    """Exact flat vectors [N, D] -> per-site (dA [N, r, d_in], dB [N, d_out, r]) views."""
    out, off = [], 0
    n = flat.shape[0]
    for s in shapes:
        a = s.r * s.d_in
        b = s.r * s.d_out
        out.append((flat[:, off : off + a].view(n, s.r, s.d_in), flat[:, off + a : off + a + b].view(n, s.d_out, s.r)))
        off += a + b
    return out


def project_flat(proj, shapes, flat: np.ndarray, chunk: int = 256) -> np.ndarray:
    out = np.zeros((flat.shape[0], proj.dim), dtype=np.float32)
    with torch.no_grad():
        for a in range(0, flat.shape[0], chunk):
            per = split_sites(shapes, torch.from_numpy(flat[a : a + chunk]))
            out[a : a + chunk] = torch.cat([proj.project(i, dA, dB) for i, (dA, dB) in enumerate(per)], 1).numpy()
    return out


def fit_from_flat(proj, shapes, flat: np.ndarray, positions, bs: int) -> None:
    """The fit `gradian.indexing.ensure_basis` does, from already captured exact vectors of the same rows."""
    f = proj.fitter()
    for _ in range(f.passes):
        for s in range(0, len(positions), bs):
            f.update_all(split_sites(shapes, torch.from_numpy(flat[positions[s : s + bs]])))
        f.end_pass()
    proj.set_basis(f.finish())


# ----------------------------------------------------------------------------------------------- fidelity


def scores_of(q: np.ndarray, rows: np.ndarray, sign: float) -> np.ndarray:
    from gradian.attribution.scoring import harm_from_inner, unit_queries

    return sign * harm_from_inner(unit_queries(q) @ rows.T)


def reranked(S_e: np.ndarray, S_p: np.ndarray, R: int) -> np.ndarray:
    """Per query: the order a user reads (top-R projected candidates re-scored exactly, first) as pseudo-scores."""
    from gradian.attribution.rerank import order_scores, rerank_order
    from gradian.attribution.scoring import rank

    out = np.empty_like(S_p, dtype=np.float64)
    for i in range(S_p.shape[0]):
        cand = rank(S_p[i], min(R, S_p.shape[1]))
        out[i] = order_scores(rerank_order(S_p[i], cand, S_e[i, cand]))
    return out


def fidelity_pair(S_e: np.ndarray, S_p: np.ndarray, R: int) -> dict:
    from gradian.attribution.rerank import agreement
    from gradian.attribution.scoring import aggregate

    rr = agreement(S_e, reranked(S_e, S_p, R))
    rr.pop("pearson", None)
    agg_e, agg_p = aggregate(S_e)[None], aggregate(S_p)[None]
    agg_rr = agreement(agg_e, reranked(agg_e, agg_p, R))
    agg_rr.pop("pearson", None)
    return {"projected": agreement(S_e, S_p), "reranked": rr,
            "aggregate": {"projected": agreement(agg_e, agg_p), "reranked": agg_rr}}


# ------------------------------------------------------------------------------------------------ overhead


def measure_overhead(model, captures: dict, toks, pad: int, bs: int, n_batches: int, reps: int) -> dict:
    """Median CPU seconds per pass over the same batches: plain forward+backward vs each hooked capture."""
    from gradian.setup.batches import collate
    from gradian.grads.objectives import per_example_loss

    allb = batches_of(toks, bs)
    pick = [allb[int(j)] for j in np.linspace(0, len(allb) - 1, min(n_batches, len(allb)))]
    data = [collate([toks[i] for i in b], pad) for b in pick]
    chunk = next(iter(captures.values())).chunk

    def plain():
        for ids, attn, sup in data:
            model.zero_grad(set_to_none=True)
            per_example_loss(model, ids, attn, sup, chunk=chunk).sum().backward()
        model.zero_grad(set_to_none=True)

    def hooked(cap):
        def run():
            for ids, attn, sup in data:
                cap.vectors(ids, attn, sup)
        return run

    fns = {"plain": plain, **{k: hooked(c) for k, c in captures.items()}}
    for f in fns.values():  # warm-up, excluded
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():  # interleaved, so drifting machine load hits every variant alike
            t = time.process_time()
            f()
            times[k].append(time.process_time() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    return {"batches": len(data), "batch_size": bs, "tokens": int(sum(int(d[1].sum()) for d in data)), "reps": reps,
            "cpu_seconds": {k: round(v, 4) for k, v in med.items()},
            "ratio": {k: round(v / med["plain"], 3) for k, v in med.items() if k != "plain"},
            "ratio_of_minima": {k: round(v / low["plain"], 3) for k, v in low.items() if k != "plain"}}


def random_lora_model(hidden: int, layers: int, r: int, vocab: int = 4096, seed: int = 0):
    """A random Llama (Llama-3 proportions: GQA, intermediate 3x) with a LoRA on all 7 projections, B non-zero."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2))
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL_PROJ))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.eval()
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def overhead_larger(hidden: int, layers: int, r: int, batch: int, seq: int, n_batches: int, reps: int) -> dict:
    """The same overhead measurement on a random model of a less toy-like shape (fixed per-op costs weigh less)."""
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.setup.tokenize import Tokenized
    from gradian.setup.model import lora_sites
    from gradian.projection.projector import Projector

    model = random_lora_model(hidden, layers, r)
    sites, _ = lora_sites(model)
    g = torch.Generator().manual_seed(0)
    toks = []
    for i in range(batch * n_batches):
        ids = torch.randint(6, 4096, (seq - (i % 7),), generator=g).tolist()
        toks.append(Tokenized(ids, [False] * (len(ids) // 2) + [True] * (len(ids) - len(ids) // 2), ""))
    caps = {"exact": GradientCapture(model, sites, Projector(site_shapes(sites)))}
    ov = measure_overhead(model, caps, toks, 0, batch, n_batches, reps)
    ov["shape"] = {"hidden": hidden, "layers": layers, "r": r, "batch": batch, "seq": seq}
    return ov


# ---------------------------------------------------------------------------------------------- loss memory

LOSS_VOCAB, LOSS_BATCH, LOSS_TOKENS, LOSS_HIDDEN = 128256, 8, 512, 16
SMOKE_LOSS = {"LOSS_VOCAB": 4096, "LOSS_BATCH": 2, "LOSS_TOKENS": 64}  # --smoke: the same children at toy sizes


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def loss_child(variant: str, chunk: int, ref: str) -> None:
    """In its own process: tiny Llama with a 128k vocab, hidden states of batch 8 x 512 supervised tokens; the peak
    RSS growth of the loss's forward+backward alone."""
    import gc

    from transformers import LlamaConfig, LlamaForCausalLM

    from gradian.grads.lm_head import backbone_hidden, chunked_head_loss
    from gradian.grads.objectives import naive_per_example_loss, supervised_positions

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=LOSS_VOCAB, hidden_size=LOSS_HIDDEN, intermediate_size=2 * LOSS_HIDDEN,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    T = LOSS_TOKENS + 1  # 512 supervised targets per row: every position after the first
    ids = torch.randint(0, LOSS_VOCAB, (LOSS_BATCH, T))
    attn = torch.ones_like(ids)
    sup = torch.ones(LOSS_BATCH, T, dtype=torch.bool)
    with torch.no_grad():
        hidden0 = backbone_hidden(model, ids, attn)
    head = model.get_output_embeddings()

    def run(kind: str, ch: int):
        hidden = hidden0.clone().requires_grad_(True)
        if kind == "naive":
            per_ex = naive_per_example_loss(head(hidden), ids, sup)
        else:
            b, pp, tp = supervised_positions(sup)
            tok = chunked_head_loss(hidden[b, pp], head.weight, head.bias, ids[b, tp], chunk=ch)
            per_ex = torch.zeros(LOSS_BATCH).index_add(0, b, tok)
        per_ex.sum().backward()
        return per_ex.detach(), hidden.grad

    gc.collect()
    try:  # reset the high-water mark to the current RSS, so transients of building the model do not mask the loss
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base_peak, base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _rss_kb()
    t = time.process_time()
    loss, grad = run(variant, chunk)
    cpu = time.process_time() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = {"variant": variant, "chunk": chunk, "peak_delta_mb": round((peak - max(base_peak, base_rss)) / 1024, 1),
           "baseline_rss_mb": round(base_rss / 1024, 1), "baseline_maxrss_mb": round(base_peak / 1024, 1),
           "cpu_seconds": round(cpu, 2), "supervised_tokens": LOSS_BATCH * LOSS_TOKENS, "vocab": LOSS_VOCAB}
    if variant == "naive":  # the reference the chunked runs compare their gradients with
        torch.save({"loss": loss, "grad": grad}, ref)
    else:
        r = torch.load(ref, weights_only=True)
        res["grad_rel_error"] = float((grad - r["grad"]).norm() / r["grad"].norm())
        res["loss_rel_error"] = float((loss - r["loss"]).norm() / r["loss"].norm())
    print(json.dumps(res), flush=True)


def measure_loss_memory(chunks: list[int], work: Path, smoke: bool = False) -> dict:
    out = {}
    ref = work / "loss-ref.pt"
    ref.unlink(missing_ok=True)
    for variant, ch in [("naive", 0)] + [("chunked", c) for c in chunks]:
        cmd = [sys.executable, __file__, "--_loss-child", variant, "--_chunk", str(ch), "--_ref", str(ref)]
        cmd += ["--smoke"] if smoke else []
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GRADIAN_THREADS": "1"})
        if r.returncode != 0:
            raise RuntimeError(f"loss memory child {variant}/{ch} failed:\n{r.stderr[-2000:]}")
        out[f"{variant}" if variant == "naive" else f"chunk_{ch}"] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


# ------------------------------------------------------------------------------------------------- sizes


def module_filter_ratio() -> dict:
    """LoRA parameters captured for a Llama-3.2-1B-shaped model, r=16: all 7 projections vs [down_proj] only."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradian.setup.model import lora_sites

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            m = get_peft_model(LlamaForCausalLM(LlamaConfig(**LLAMA_1B)),
                               LoraConfig(r=16, lora_alpha=32, target_modules=ALL_PROJ))
    every, _ = lora_sites(m)
    down, _ = lora_sites(m, ["down_proj"])
    a, d = sum(s.numel for s in every), sum(s.numel for s in down)
    return {"ratio": round(a / d, 3), "all_params": a, "down_proj_params": d, "all_sites": len(every),
            "down_sites": len(down), "min_projection_dim_all": sum(2 * s.r for s in every),
            "min_projection_dim_down": sum(2 * s.r for s in down)}


def bytes_per_example(dims: dict, work: Path) -> dict:
    """Measured on disk: a 64-row index per setting, shard files (rows + norms) / rows."""
    from gradian.store.index import GradientIndex

    out = {}
    rng = np.random.default_rng(0)
    for name, dim in dims.items():
        for dtype in ("float32", "float16", "bfloat16"):
            root = work / f"bytes-{name}-{dtype}"
            shutil.rmtree(root, ignore_errors=True)
            vecs = rng.standard_normal((64, dim)).astype(np.float32)
            with GradientIndex.open(root, key="b", dim=dim, storage_dtype=dtype, shard_rows=64) as ix:
                ix.add([f"r{i}" for i in range(64)], vecs)
                ix.flush()
                out[f"{name}/{dtype}"] = {"dim": dim, "bytes": round(ix.nbytes / 64, 1)}
            shutil.rmtree(root, ignore_errors=True)
    return out


def fp16_recall(S_e_fn, vecs: np.ndarray, work: Path, dtype: str) -> dict:
    """Top-50 recall of scores read back from a `dtype` index vs the float32 scores of the same vectors, worst
    query; with the worst query's gap between its 50th and 51st float32 scores and its largest score error, so a
    miss can be told apart as a near-tie at the boundary (gap < error) or a real loss."""
    from gradian.attribution.rerank import topk_recall
    from gradian.store.index import GradientIndex

    root = work / f"fp16-{dtype}"
    shutil.rmtree(root, ignore_errors=True)
    keys = [f"r{i}" for i in range(len(vecs))]
    with GradientIndex.open(root, key="f", dim=vecs.shape[1], storage_dtype=dtype, shard_rows=1024) as ix:
        ix.add(keys, vecs)
        stored = ix.rows(keys)
    shutil.rmtree(root, ignore_errors=True)
    S_32, S_h = S_e_fn(vecs), S_e_fn(stored)
    rec = [topk_recall(a, b, 50) for a, b in zip(S_32, S_h)]
    w = int(np.argmin(rec))
    top = np.sort(S_32[w])[::-1]
    return {"top50_recall": float(rec[w]), "boundary_gap": float(top[49] - top[50]) if top.size > 50 else None,
            "max_score_error": float(np.abs(S_32[w] - S_h[w]).max()), "score_scale": float(abs(top[0]))}


def scoring_throughput(work: Path, mb: int, dim: int, queries: int, dtype: str) -> dict:
    from gradian.store.index import GradientIndex

    root = work / f"score-{dtype}"
    shutil.rmtree(root, ignore_errors=True)
    item = 4 if dtype == "float32" else 2
    n = (mb << 20) // (dim * item)
    rng = np.random.default_rng(0)
    keys = [f"r{i:07d}" for i in range(n)]
    with GradientIndex.open(root, key="s", dim=dim, storage_dtype=dtype, shard_rows=4096) as ix:
        for a in range(0, n, 4096):
            ix.add(keys[a : a + 4096], rng.standard_normal((min(4096, n - a), dim)).astype(np.float32))
        ix.flush()
        q = rng.standard_normal((queries, dim)).astype(np.float32)
        ix.score(q, keys[:4096])  # warm-up (page cache, BLAS)
        best = []
        for _ in range(3):
            t = time.perf_counter()
            ix.score(q, keys)
            best.append(time.perf_counter() - t)
        nbytes = ix.nbytes
    shutil.rmtree(root, ignore_errors=True)
    s = min(best)
    return {"dtype": dtype, "rows": n, "dim": dim, "queries": queries, "index_mb": round(nbytes / 2**20, 1),
            "seconds": round(s, 3), "gb_per_s": round(nbytes / s / 1e9, 3)}


# ------------------------------------------------------------------------------------------- mid-size model

# The trained mid-size model of the demo world: the largest that pretrains in a few CPU minutes here (hidden 512 x 8
# layers x vocab 32k would take about an hour on one of these cores; the LM head of a 32k vocabulary alone costs
# twice the body at hidden 256). The world's BPE stops at about 1,000 entries (no pair occurs twice beyond that).
MID_SPEC = dict(hidden_size=256, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=1024, epochs=12,
                max_position=256)
MID_WIDTHS = [256, 512, 1024, 2048, 4096, 8192]
MID_LORA = {"lora_r": 16, "lora_alpha": 32.0}


def mid_fidelity(work: Path, seed: int, n_rows: int, widths: list[int], rerank: int, *, spec_kw: dict | None = None,
                 train: dict | None = None) -> dict:
    """The data-aware projection on the trained mid-size model (`MID_SPEC`, LoRA r 16 on all 7 projections, the
    substitution scenario): one streaming pass over the rows computes the exact scores and every width's projected
    scores (no [rows, exact width] matrix: 360k dims x 3000 rows would be 4.3 GB), then the re-ranked figures."""
    from gradian.attribution.queries import query_items, query_vectors, select_failing
    from gradian.config import GradsConfig, load_config
    from gradian.demo.run import write_demo_config
    from gradian.demo.scenario import make_substitution_scenario, write_scenario
    from gradian.demo.tiny import TinySpec, build_tiny_base, read_build_info
    from gradian.demo.world import World
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.pipeline import evaluate
    from gradian.projection import Projector
    from gradian.setup.batches import collate
    from gradian.setup.records import dataset_fingerprint, load_train
    from gradian.setup.session import open_session
    from gradian.setup.tokenize import tokenize_example
    from gradian.store.build import basis_sample
    from gradian.training.loop import train_adapter
    from gradian.training.recipe import read_recipe

    spec_kw = MID_SPEC if spec_kw is None else spec_kw
    spec = TinySpec(**spec_kw)
    t0 = time.process_time()
    base = build_tiny_base(spec, progress=False)
    info = read_build_info(base)
    world = World.generate(seed=spec.seed, n_entities=spec.n_entities)
    run_dir = work / "mid-run"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_scenario(make_substitution_scenario(world, seed=seed), run_dir)
    cfg_path = write_demo_config(run_dir, base, train={**MID_LORA, "save_checkpoints": False, **(train or {})})
    cfg = load_config(cfg_path)
    rec = read_recipe(run_dir / "adapter")
    if rec is None or rec.dataset_fingerprint != dataset_fingerprint(load_train(run_dir / "train.jsonl")):
        log("mid: training the scenario's LoRA adapter (r 16, all 7 projections) ...")
        train_adapter(cfg, progress=False)
    torch.set_num_threads(1)
    s = open_session(cfg)
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing[: cfg.attribution.max_items], "contrastive")
    sign = -1.0 if direction == "improvement" else 1.0
    toks = list(s.toks)
    toks += [tokenize_example(s.tokenizer, e, cfg.grads.max_seq_length)
             for e in pool_examples(world, max(0, n_rows - len(toks)), len(toks))]
    pad, bs = s.tokenizer.pad_token_id, cfg.grads.batch_size
    shapes = site_shapes(s.sites)
    exact_cap = GradientCapture(s.model, s.sites, Projector(shapes), chunk=cfg.grads.loss_chunk_tokens)
    Qe = query_vectors(exact_cap, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=cfg.grads.max_seq_length,
                       batch_size=bs).numpy()
    projs = {w: Projector(shapes, w, "data-aware", GradsConfig().projection_seed) for w in widths}
    # one fit (its two passes do not depend on the width), finished once per width: `finish` shares the fitter's
    # `dim` out over the sides' largest eigenvalues, so it is set to each projector's width in turn
    fit_pos = basis_sample(toks, DEFAULT_FIT_ROWS_MID, GradsConfig().projection_seed)
    fitter = projs[widths[0]].fitter()
    t_fit = time.process_time()
    for _ in range(fitter.passes):
        for b in range(0, len(fit_pos), bs):
            ids, attn, sup = collate([toks[i] for i in fit_pos[b : b + bs]], pad)
            it, _ = exact_cap.iter_site_grads(ids, attn, sup)
            for i, (dA, dB) in it:
                fitter.update(i, dA, dB)
        fitter.end_pass()
    for w, pr in projs.items():
        fitter.dim = pr.dim
        pr.set_basis(fitter.finish())
    t_fit = time.process_time() - t_fit
    Qp = {w: project_flat(pr, shapes, Qe) for w, pr in projs.items()}
    S_e = np.zeros((len(qitems), len(toks)), dtype=np.float32)
    S_p = {w: np.zeros_like(S_e) for w in widths}
    from gradian.attribution.scoring import unit_queries

    ue = unit_queries(Qe)
    up = {w: unit_queries(q) for w, q in Qp.items()}
    t_rows = time.process_time()
    for batch in batches_of(toks, bs):
        ids, attn, sup = collate([toks[i] for i in batch], pad)
        it, _ = exact_cap.iter_site_grads(ids, attn, sup)
        per = [g for _, g in it]
        flat = torch.cat([torch.cat([dA.flatten(1), dB.flatten(1)], 1) for dA, dB in per], 1).numpy()
        S_e[:, batch] = sign * -(ue @ flat.T)
        with torch.no_grad():
            for w, pr in projs.items():
                v = torch.cat([pr.project(i, dA, dB) for i, (dA, dB) in enumerate(per)], 1).numpy()
                S_p[w][:, batch] = sign * -(up[w] @ v.T)
    t_rows = time.process_time() - t_rows
    fid = {}
    for w in widths:
        f = fidelity_pair(S_e, S_p[w], rerank)
        f["dim"] = projs[w].dim
        fid[str(w)] = f
    meets = [w for w in widths if _meets(fid[str(w)]["reranked"])]
    return {"spec": {**spec_kw, "vocab": info.get("vocab_size"), "parameters": info.get("n_parameters"),
                     "exact_match": info.get("exact_match"), "pretrain_cpu_seconds": info.get("build_cpu_seconds")},
            "lora": MID_LORA, "sites": len(shapes), "exact_dim": int(sum(x.numel for x in shapes)),
            "rows": len(toks), "queries": len(qitems), "direction": direction,
            "capability": {"base": cap.base, "tuned": cap.tuned, "delta": cap.delta},
            "fit_cpu_seconds": round(t_fit, 1), "rows_cpu_seconds": round(t_rows, 1), "fidelity": fid,
            "smallest_width_meeting": min(meets) if meets else None, "seconds_cpu": round(time.process_time() - t0, 1)}


DEFAULT_FIT_ROWS_MID = 512


def shape_overhead(reps: int, n_batches: int, shape=None, fit_rows: int = 512) -> dict:
    """`measure_overhead` on the SmolLM-135M shape (`gradian.demo.shapes`, its fixture run: LoRA r 16 on all 7
    projections): plain forward+backward against the exact capture and the default projection (data-aware at
    `AUTO_WIDTH`, fitted on the fixture's rows)."""
    from gradian.config import load_config
    from gradian.demo.shapes import SMOLLM_135M, RunSpec, shape_run, write_shape_config
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.projection import Projector
    from gradian.setup.session import open_session
    from gradian.store.build import basis_sample

    shape = shape or SMOLLM_135M
    tmpl = shape_run(shape, RunSpec())
    with tempfile.TemporaryDirectory(prefix="gradian-shape-overhead-") as d:  # the run's files, gone after
        s = open_session(load_config(write_shape_config(Path(d), tmpl)), need_eval=False)
        torch.set_num_threads(1)
        toks, pad, bs = s.toks, s.pad_id, s.cfg.grads.batch_size
        shapes = site_shapes(s.sites)
        exact = GradientCapture(s.model, s.sites, Projector(shapes))
        proj = Projector(shapes, AUTO_WIDTH, "data-aware")
        from gradian.setup.batches import collate

        fit = proj.fitter()
        pos = basis_sample(toks, fit_rows, 0)
        for _ in range(fit.passes):
            for b in range(0, len(pos), bs):
                it, _ = exact.iter_site_grads(*collate([toks[i] for i in pos[b : b + bs]], pad))
                for i, (dA, dB) in it:
                    fit.update(i, dA, dB)
            fit.end_pass()
        proj.set_basis(fit.finish())
        caps = {"exact": exact, f"data-aware_{AUTO_WIDTH}": GradientCapture(s.model, s.sites, proj)}
        ov = measure_overhead(s.model, caps, toks, pad, bs, n_batches, reps)
        ov["shape"] = {"name": shape.name, "sites": len(shapes), "exact_dim": sum(x.numel for x in shapes)}
        return ov


def run_new_sections(out: dict, text: list, work: Path, args, sections: set) -> None:
    if "mid" in sections:
        t0 = time.time()
        n = args.rows or (1200 if args.quick else 3000)
        # --smoke: the demo's own tiny base (cached) for the mid-size one, one epoch, one width
        m = (mid_fidelity(work, args.seed, n, [512], 20, spec_kw={}, train={"epochs": 1}) if args.smoke else
             mid_fidelity(work, args.seed, n, MID_WIDTHS, 200))
        out["mid"] = m
        rows = []
        for w, f in m["fidelity"].items():
            p, r = f["projected"], f["reranked"]
            rows.append([w, f["dim"], p["top50_recall"], p["spearman_top5pct"], r["top10_recall"], r["top50_recall"],
                         r["spearman_top5pct"], f["aggregate"]["reranked"]["top50_recall"]])
        text.append(table(
            f"default projection on the trained mid-size model (hidden {MID_SPEC['hidden_size']}, "
            f"{MID_SPEC['n_layers']} layers, vocab {m['spec']['vocab']}, exact match {m['spec']['exact_match']:.3f}; "
            f"LoRA r 16 x 7: {m['sites']} sites, {m['exact_dim']} exact dims; {m['rows']} rows, {m['queries']} "
            f"queries; rr = top 200 re-scored exactly)",
            ["width", "dim", "top50", "sp_top5%", "rr_top10", "rr_top50", "rr_sp_top5%", "agg_rr_top50"], rows))
        log(f"mid done in {time.time() - t0:.0f}s")
    if "shape_overhead" in sections:
        t0 = time.time()
        if args.smoke:  # a toy Llama shape for the SmolLM-135M one (bench/gpu_check.py's, built in seconds, cached)
            from gradian.demo.shapes import ShapeSpec

            ov = shape_overhead(1, 1, ShapeSpec("smoke-llama", "llama", 128, 384, 4, 4, 2, 8192, True,
                                                max_position=2048), fit_rows=16)
        else:
            ov = shape_overhead(3 if args.quick else 5, 4 if args.quick else 8)
        out["shape_overhead"] = ov
        text.append(table(f"capture overhead on the {ov['shape']['name']} shape ({ov['shape']['sites']} sites, "
                          f"{ov['shape']['exact_dim']} exact dims; {ov['batches']} batches of {ov['batch_size']}, "
                          f"median of {ov['reps']})", ["variant", "cpu_s", "ratio_vs_plain", "ratio_of_minima"],
                          [["plain fwd+bwd", ov["cpu_seconds"]["plain"], 1.0, 1.0]]
                          + [[k, ov["cpu_seconds"][k], ov["ratio"][k], ov["ratio_of_minima"][k]] for k in ov["ratio"]]))
        log(f"shape overhead done in {time.time() - t0:.0f}s")


# ----------------------------------------------------------------------------------------------------- main


def _meets(rr: dict) -> bool:
    return (rr["top50_recall"] >= TARGETS["top50_recall_reranked"]
            and rr["spearman_top5pct"] >= TARGETS["spearman_top5pct_reranked"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows, widths, repetitions (about 4 CPU minutes)")
    ap.add_argument("--work", default=None, help="scratch directory (default $TMPDIR/gradian-bench; with --smoke, "
                    "bench/_smoke.py's work directory)")
    ap.add_argument("--rows", type=int, default=None, help="rows scored for fidelity (default 1200 quick / 3000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: fidelity,overhead,loss,bytes,score")
    ap.add_argument("--_loss-child", dest="loss_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_chunk", dest="chunk", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--_ref", dest="ref", default="", help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="run only these new sections: mid (the default projection on the "
                    "trained mid-size model), shape_overhead (capture overhead on the SmolLM-135M shape)")
    ap.add_argument("--smoke", action="store_true",
                    help="every section at toy sizes on bench/_smoke.py's tiny scenario (64 rows, one width, one "
                         "repetition): checks the script runs, in seconds; its figures mean nothing")
    args = ap.parse_args()
    if args.smoke:
        from _smoke import work_dir

        globals().update(SMOKE_LOSS)
        args.rows = args.rows or 64
        # its scratch in the smoke's work directory: the toy mid-run's adapter and the loss reference are the smoke's
        # own, never a full run's in $TMPDIR/gradian-bench (nor reused from one)
        args.work = args.work or str(work_dir("index_bench"))
    args.work = args.work or os.path.join(tempfile.gettempdir(), "gradian-bench")
    if args.loss_child:
        loss_child(args.loss_child, args.chunk, args.ref)
        return
    only = set(filter(None, args.only.split(",")))
    if only:
        out = {"schema": "gradian.bench.index/1", "quick": args.quick, "only": sorted(only)}
        text = []
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        run_new_sections(out, text, work, args, only)
        print("\n\n".join(text))
        print(json.dumps(out, separators=(",", ":")))
        return

    from gradian.pipeline import evaluate
    from gradian.setup.session import open_session
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.config import GradsConfig, load_config
    from gradian.setup.tokenize import tokenize_example
    from gradian.demo.tiny import TinySpec
    from gradian.demo.world import World
    from gradian.store.build import basis_sample
    from gradian.projection.projector import DEFAULT_FIT_ROWS, Projector
    from gradian.attribution.queries import query_items, query_vectors, select_failing

    t_all = time.time()
    skip = set(filter(None, args.skip.split(",")))
    quick = args.quick
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {"schema": "gradian.bench.index/1", "quick": quick, "smoke": args.smoke, "torch": torch.__version__,
                 "threads": 1}
    text: list[str] = []
    gdef = GradsConfig()
    default_kind = gdef.projection_kind

    # ---- setup: model, adapter, failing items, rows
    t0 = time.time()
    if args.smoke:
        from _smoke import tiny_run

        cfg_path, source = tiny_run() / "gradian.yaml", "bench/_smoke.py tiny scenario"
    else:
        cfg_path, source = prepare(work, args.seed)
    cfg = load_config(cfg_path)
    s = open_session(cfg)
    torch.set_num_threads(1)
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing[: cfg.attribution.max_items], "contrastive")
    if not qitems:  # nothing failed: fall back to held-out eval prompts (classic queries)
        qitems = query_items(cap, s.eval_items, list(range(len(s.eval_items))), "classic")
        direction = "regression"
    sign = -1.0 if direction == "improvement" else 1.0
    n_rows = args.rows or (1200 if quick else 3000)
    world = World.generate(seed=TinySpec().seed, n_entities=TinySpec().n_entities)
    toks = list(s.toks)
    extra = pool_examples(world, max(0, n_rows - len(toks)), len(toks))
    toks += [tokenize_example(s.tokenizer, e, cfg.grads.max_seq_length) for e in extra]
    pad = s.tokenizer.pad_token_id
    shapes = site_shapes(s.sites)
    exact_cap = GradientCapture(s.model, s.sites, Projector(shapes), chunk=cfg.grads.loss_chunk_tokens)
    t1 = time.process_time()
    E = exact_vectors(exact_cap, toks, pad, cfg.grads.batch_size)
    build_cpu = time.process_time() - t1
    Q = query_vectors(exact_cap, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=cfg.grads.max_seq_length,
                      batch_size=cfg.grads.batch_size).numpy()
    S_e = scores_of(Q, E, sign)
    formulations = sorted({q.formulation for q in qitems})
    setup = {"scenario": source, "train_rows": len(s.toks), "rows_scored": len(toks), "extra_world_rows": len(extra),
             "queries": len(qitems), "formulation": formulations, "direction": direction,
             "capability": {"base": cap.base, "tuned": cap.tuned, "delta": cap.delta},
             "sites": len(shapes), "exact_dim": int(E.shape[1]), "min_projected_dim": sum(2 * x.r for x in shapes),
             "exact_capture_rows_per_cpu_s": round(len(toks) / build_cpu, 1), "rerank": gdef.rerank,
             "fit_rows": DEFAULT_FIT_ROWS, "setup_seconds": round(time.time() - t0, 1)}
    out["setup"] = setup
    text.append(table("setup (tiny demo model, scenario LoRA adapter)", ["item", "value"],
                      [[k, json.dumps(v) if isinstance(v, (dict, list)) else v] for k, v in setup.items()]))
    log(f"setup done in {time.time() - t0:.0f}s: {len(toks)} rows, {len(qitems)} queries, dim {E.shape[1]}")

    # ---- fidelity per kind and width
    projectors: dict = {}
    if "fidelity" not in skip:
        t0 = time.time()
        widths = [w for w in WIDTHS if w <= E.shape[1]]
        if quick:
            widths = [w for w in widths if w <= 2048]
        if args.smoke:
            widths = [512]
        fid: dict = {}
        rows = []
        fit_pos = basis_sample(toks, DEFAULT_FIT_ROWS, gdef.projection_seed)
        for kind in KINDS:
            fid[kind] = {}
            for w in widths:
                if w < setup["min_projected_dim"] and kind != "data-aware":
                    fid[kind][str(w)] = {"error": f"below the minimum LoRA-aware width {setup['min_projected_dim']}"}
                    rows.append([kind, w, "-", "n/a: below the minimum width"] + [""] * 9)
                    continue
                proj = Projector(shapes, w, kind, gdef.projection_seed)
                t_fit = time.process_time()
                if proj.needs_fit:
                    fit_from_flat(proj, shapes, E, fit_pos, cfg.grads.batch_size)
                t_fit = time.process_time() - t_fit
                P = project_flat(proj, shapes, E)
                S_p = scores_of(project_flat(proj, shapes, Q), P, sign)
                f = fidelity_pair(S_e, S_p, gdef.rerank)
                f["dim"] = proj.dim
                if kind == "data-aware":
                    f["fit_cpu_seconds"] = round(t_fit, 2)  # from captured vectors: excludes the 2 capture passes
                fid[kind][str(w)] = f
                projectors[(kind, w)] = (proj, P)
                p, r = f["projected"], f["reranked"]
                rows.append([kind, w, proj.dim, p["top10_recall"], p["top50_recall"], p["spearman_top5pct"],
                             p["pearson"], p["spearman"], r["top10_recall"], r["top50_recall"], r["spearman_top5pct"],
                             r["spearman"], f["aggregate"]["reranked"]["top50_recall"]])
        out["fidelity"] = fid
        text.append(table(
            f"fidelity vs exact ({len(toks)} rows, {len(qitems)} {'/'.join(formulations)} queries, mean per query; "
            f"'rr' = top {gdef.rerank} projected re-scored exactly)",
            ["kind", "width", "dim", "top10", "top50", "sp_top5%", "pearson", "spearman", "rr_top10", "rr_top50",
             "rr_sp_top5%", "rr_spearman", "agg_rr_top50"], rows))
        log(f"fidelity done in {time.time() - t0:.0f}s")

    # ---- storage: fp16 recall, bytes per example
    t0 = time.time()
    prec = {"fp16_top50_recall": fp16_recall(lambda v: scores_of(Q, v, sign), E, work, "float16")}
    if not quick:
        prec["bf16_top50_recall"] = fp16_recall(lambda v: scores_of(Q, v, sign), E, work, "bfloat16")
    if (default_kind, 1024) in projectors:
        proj, P = projectors[(default_kind, 1024)]
        Qp = project_flat(proj, shapes, Q)
        prec["fp16_top50_recall_projected_1024"] = fp16_recall(lambda v: scores_of(Qp, v, sign), P, work, "float16")
    for k, v in prec.items():
        out[k] = v["top50_recall"]
    out["storage_precision"] = prec
    if "bytes" not in skip:
        dims = {"exact": int(E.shape[1])}
        for w in ([512] if args.smoke else WIDTHS):
            if setup["min_projected_dim"] <= w <= E.shape[1]:
                dims[f"proj{w}"] = Projector(shapes, w, "rademacher").dim
        bpe = bytes_per_example(dims, work)
        out["bytes_per_example"] = bpe
        names = list(dims)
        text.append(table("bytes per example on disk (shard rows + fp32 norms for half types; headers amortised "
                          "over 64 rows)", ["setting", "dim", "float32", "float16", "bfloat16"],
                          [[n, dims[n]] + [bpe[f"{n}/{d}"]["bytes"] for d in ("float32", "float16", "bfloat16")]
                           for n in names]))
    mf = module_filter_ratio()
    out["module_filter_ratio"] = mf["ratio"]
    out["module_filter"] = mf
    text.append(table("module filter, Llama-3.2-1B shape (r=16), from the config on the meta device",
                      ["item", "value"], [[k, v] for k, v in mf.items()]))
    text.append(table("storage precision (top-50 recall of scores read back vs float32, worst query; its gap between "
                      "the 50th and 51st score, and its largest score error)",
                      ["setting", "top50_recall", "boundary_gap", "max_score_err", "top_score"],
                      [[k, v["top50_recall"], v["boundary_gap"], v["max_score_error"], v["score_scale"]]
                       for k, v in prec.items()]))
    log(f"storage done in {time.time() - t0:.0f}s")

    # ---- capture overhead
    if "overhead" not in skip:
        t0 = time.time()
        caps = {"exact": exact_cap}
        if (default_kind, 1024) in projectors:
            caps[f"{default_kind}_1024"] = GradientCapture(s.model, s.sites, projectors[(default_kind, 1024)][0],
                                                           chunk=cfg.grads.loss_chunk_tokens)
        n_b, reps = (1, 1) if args.smoke else (6, 5) if quick else (16, 9)
        ov = measure_overhead(s.model, caps, toks, pad, cfg.grads.batch_size, n_b, reps)
        out["overhead_ratio"] = ov["ratio"]["exact"]
        out["overhead"] = ov
        rows = [["demo (h128, 2 layers, r8)", "plain fwd+bwd (LoRA .grad)", ov["cpu_seconds"]["plain"], 1.0, 1.0]]
        rows += [["", f"hooked {k}", ov["cpu_seconds"][k], ov["ratio"][k], ov["ratio_of_minima"][k]] for k in caps]
        if not quick and not args.smoke:
            big = overhead_larger(512, 4, 16, 8, 128, 4, 5)
            out["overhead_larger"] = big
            out["overhead_ratio_larger"] = big["ratio"]["exact"]
            rows += [["random h512, 4 layers, r16", "plain fwd+bwd (LoRA .grad)", big["cpu_seconds"]["plain"], 1.0,
                      1.0],
                     ["", "hooked exact", big["cpu_seconds"]["exact"], big["ratio"]["exact"],
                      big["ratio_of_minima"]["exact"]]]
        text.append(table(f"capture overhead: CPU s per pass over the same batches (demo: {ov['batches']} batches of "
                          f"{ov['batch_size']}, {ov['tokens']} tokens), median of {ov['reps']}, warm-up excluded",
                          ["model", "variant", "cpu_s", "ratio_vs_plain", "ratio_of_minima"], rows))
        log(f"overhead done in {time.time() - t0:.0f}s")

    # ---- loss peak memory
    if "loss" not in skip:
        t0 = time.time()
        chunks = [gdef.loss_chunk_tokens, 256] if quick else [gdef.loss_chunk_tokens, 2048, 512, 256, 128]
        if args.smoke:
            chunks = [gdef.loss_chunk_tokens]
        lm = measure_loss_memory(chunks, work, smoke=args.smoke)
        naive = lm["naive"]["peak_delta_mb"]
        ratios = {k: round(v["peak_delta_mb"] / naive, 4) for k, v in lm.items() if k != "naive"}
        out["loss_peak_ratio"] = ratios[f"chunk_{gdef.loss_chunk_tokens}"]
        ok = [int(k.split("_")[1]) for k, r in ratios.items() if r <= TARGETS["loss_peak_ratio"]]
        out["loss_peak_chunk_meeting_target"] = max(ok) if ok else None
        out["loss_grad_rel_error"] = max(v["grad_rel_error"] for k, v in lm.items() if k != "naive")
        out["loss_memory"] = {"runs": lm, "ratios": ratios}
        text.append(table(f"loss peak memory: batch {LOSS_BATCH} x {LOSS_TOKENS} supervised tokens, vocab "
                          f"{LOSS_VOCAB}, forward+backward of the loss only, own process each (ru_maxrss growth)",
                          ["variant", "peak_MB", "ratio", "cpu_s", "grad_rel_err"],
                          [[k, v["peak_delta_mb"], ratios.get(k, 1.0), v["cpu_seconds"], v.get("grad_rel_error", "")]
                           for k, v in lm.items()]))
        log(f"loss memory done in {time.time() - t0:.0f}s")

    # ---- scoring throughput
    if "score" not in skip:
        t0 = time.time()
        runs = [scoring_throughput(work, 1, 512, 4, "float32") if args.smoke else
                scoring_throughput(work, 256 if quick else 512, 8192, 32, "float32")]
        if not quick and not args.smoke:
            runs.append(scoring_throughput(work, 512, 8192, 32, "float16"))
        out["scoring_gb_per_s"] = runs[0]["gb_per_s"]
        out["scoring"] = runs
        text.append(table("GradientIndex.score throughput (index in page cache, best of 3)",
                          ["dtype", "rows", "dim", "queries", "index_MB", "seconds", "GB/s"],
                          [[r["dtype"], r["rows"], r["dim"], r["queries"], r["index_mb"], r["seconds"], r["gb_per_s"]]
                           for r in runs]))
        log(f"scoring done in {time.time() - t0:.0f}s")

    # ---- real shapes: the default projection on the trained mid-size model, the capture overhead at 135M
    run_new_sections(out, text, work, args, {"mid", "shape_overhead"} - skip)

    # ---- summary against the targets
    summ = []
    ok: dict = {}
    if "overhead_ratio" in out:
        ok["overhead_ratio"] = out["overhead_ratio"] <= TARGETS["overhead_ratio"]
        summ.append(["overhead_ratio (exact capture / plain)", out["overhead_ratio"],
                     f"<= {TARGETS['overhead_ratio']}"])
    if "fidelity" in out:
        best = {}
        for kind, per in out["fidelity"].items():
            for w, f in per.items():
                if "error" in f or int(w) > 1024:
                    continue
                if _meets(f["reranked"]):
                    best[kind] = min(best.get(kind, int(w)), int(w))
        out["smallest_width_meeting_fidelity"] = best
        d = out["fidelity"].get(default_kind, {}).get("1024", {})
        if "reranked" in d:
            rr = d["reranked"]
            ok["fidelity_1024_default"] = _meets(rr)
            summ.append([f"{default_kind} @1024 rr top50 / sp_top5%",
                         f"{rr['top50_recall']:.3f} / {rr['spearman_top5pct']:.3f}", ">= 0.95 / 0.95"])
        summ.append(["smallest width meeting it, per kind", json.dumps(best), "<= 1024"])
    if "loss_peak_ratio" in out:
        ok["loss_peak_ratio"] = out["loss_peak_ratio"] <= TARGETS["loss_peak_ratio"]
        summ.append([f"loss_peak_ratio (chunk {gdef.loss_chunk_tokens})", out["loss_peak_ratio"], "<= 0.15"])
        summ.append(["largest chunk meeting 0.15", out["loss_peak_chunk_meeting_target"], ""])
        summ.append(["loss grad rel error vs unchunked", f"{out['loss_grad_rel_error']:.2e}", "< 1e-6"])
        ok["loss_grad_rel_error"] = out["loss_grad_rel_error"] < 1e-6
    ok["fp16_top50_recall"] = out["fp16_top50_recall"] >= TARGETS["fp16_top50_recall"]
    summ.append(["fp16_top50_recall", out["fp16_top50_recall"], "= 1.0"])
    if "scoring_gb_per_s" in out:
        summ.append(["scoring_gb_per_s", out["scoring_gb_per_s"], ""])
    summ.append(["module_filter_ratio (1B, all 7 / down_proj)", out["module_filter_ratio"], ""])
    if "mid" in out:
        d = out["mid"]["fidelity"].get(str(AUTO_WIDTH), {}).get("reranked")
        if d:
            ok["mid_default_projection"] = _meets(d)
            summ.append([f"mid-size model, default projection ({AUTO_WIDTH}) rr top50 / sp_top5%",
                         f"{d['top50_recall']:.3f} / {d['spearman_top5pct']:.3f}", ">= 0.95 / 0.95"])
    if "shape_overhead" in out:
        r = out["shape_overhead"]["ratio"].get(f"data-aware_{AUTO_WIDTH}")
        if r is not None:
            ok["shape_overhead_default"] = r <= TARGETS["shape_overhead_default"]
            summ.append([f"135M shape: capture overhead, default projection ({AUTO_WIDTH})", r, "<= 1.10"])
    out["targets"] = TARGETS
    out["meets"] = ok
    out["default_projection_kind"] = default_kind
    out["seconds"] = round(time.time() - t_all, 1)
    text.append(table("summary", ["figure", "value", "target"], summ))
    print("\n\n".join(text))
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
