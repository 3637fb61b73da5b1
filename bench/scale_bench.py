"""Scale benchmark (a measurement, not a test): `gradian attribute` on real-shaped models and at many rows, per stage.

    .venv/bin/python bench/scale_bench.py                       # everything: fixtures, rows, estimates (~30 min)
    .venv/bin/python bench/scale_bench.py fixtures --quick      # the 135M shape, defaults and nf4 only
    .venv/bin/python bench/scale_bench.py rows --rows 20000,100000
    .venv/bin/python bench/scale_bench.py estimates             # meta-device shapes, no weights (seconds)
    .venv/bin/python bench/scale_bench.py quant                 # nf4/int8 capture vs the naive reference
    .venv/bin/python bench/scale_bench.py --smoke               # every section at toy sizes (make bench-smoke)

* **fixtures**: the SmolLM-135M and Qwen2.5-0.5B-width shapes (`gradian.demo.shapes`; random weights, LoRA r 16 on
  all 7 projections, built locally and cached) run end to end with the defaults, with `grads.projection_dim: 8192`,
  `grads.storage_dtype: float16` and `model.quantization: nf4`, at several row counts and widths (exact, 1024).
* **rows**: the demo world at 20,000 and 100,000 training rows (the tiny model and the demo scenario's adapter, its
  300 rows first), with the defaults.
* **estimates**: Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-7B and Gemma-2-9B on the meta device: LoRA sites, exact width,
  what `grads.projection_dim: auto` picks, and the memory of each stage from its formula.

Every run is its own process (`--_child`), so each peak is its own; inside it `stage_probe.StageProbe` gives each
stage's peak RSS (VmHWM reset at the stage's start), CPU seconds (`time.process_time`) and tokens. The last line is
one JSON object (`"schema": "gradian.bench.scale/1"`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 1 << 30
AFTER_INDEX = ["precondition", "score", "windows", "rerank", "checkpoints", "base_scores", "spans", "clusters",
               "blame", "report"]
ROWS_INDEPENDENT = ["fit", "clusters", "rerank"]  # the fit, the sketch and the self-check


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def table(title: str, header: list, rows: list) -> str:
    def fmt(c):
        if isinstance(c, float):
            return f"{c:.3f}" if abs(c) < 100 else f"{c:.0f}"
        return "" if c is None else str(c)

    cells = [[str(h) for h in header]] + [[fmt(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([f"== {title}", line(cells[0]), "  ".join("-" * x for x in w)] + [line(r) for r in cells[1:]])


# ------------------------------------------------------------------------------------------------ children


def child(spec: dict) -> dict:
    """One attribute run in this process, probed per stage."""
    import torch

    torch.set_num_threads(1)
    from stage_probe import StageProbe

    from gradian import api
    from gradian.runtime import quiet_libraries

    quiet_libraries()
    run_dir = Path(spec["run_dir"])
    if spec["kind"] == "shape":
        from gradian.demo.shapes import SAVED_SHAPES, RunSpec, ShapeSpec, shape_run, write_shape_config

        shape = ShapeSpec(**spec["shape_spec"]) if "shape_spec" in spec else SAVED_SHAPES[spec["shape"]]
        tmpl = shape_run(shape, RunSpec(rows=spec["rows"], quantization=spec.get("quantization", "none"),
                                        device=spec.get("device", "cpu"), dtype=spec.get("dtype", "float32")))
        cfg_path = write_shape_config(run_dir, tmpl, extra=spec.get("extra", {}))
        model_bytes = sum(f.stat().st_size for f in Path(json.loads((tmpl / "build.json").read_text())["base"]).glob(
            "*.safetensors"))
    else:
        cfg_path = Path(spec["config"])
        model_bytes = sum(f.stat().st_size for f in Path(spec["base"]).glob("*.safetensors"))
    cfg = api.load_config(cfg_path, spec.get("sets", []))
    import shutil

    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a fresh index every run: a reused one measures nothing
    if cfg.grads.cache_dir:
        shutil.rmtree(cfg.index_dir, ignore_errors=True)
    probe = StageProbe()
    probe.cuda = spec.get("device", "cpu").startswith("cuda")
    probe.install()
    t0, w0 = time.process_time(), time.perf_counter()
    rep = api.attribute(cfg).to_dict()
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    ix = rep.get("index") or {}
    stages = probe.table()
    by = {r["stage"]: r for r in stages}
    idx = by.get("index", {})
    fit = by.get("fit", {})
    n = ix.get("examples") or 0
    foot = getattr(probe, "model_footprint", None)
    out = {"label": spec["label"], "verdict": rep["verdict"], "rows": n, "model_bytes": model_bytes,
           "model_footprint_mb": round(foot / 2**20, 1) if foot else None,
           "peak_mb": round(probe.process_peak_kb / 1024, 1), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
           "index_dim": ix.get("dim"), "index_bytes": ix.get("bytes"), "projection_choice": ix.get("projection_choice"),
           "bytes_per_row": round(ix["bytes"] / n, 1) if n else None,
           "index_cpu_s_per_row": round(idx.get("cpu_s", 0) / n, 4) if n else None,
           "index_build_cpu_s": round(idx.get("cpu_s", 0) - fit.get("cpu_s", 0), 3),
           "built_rows": ix.get("built_rows"), "fidelity": (ix.get("fidelity") or {}).get("reranked"),
           "stages": stages,
           "metrics": rep.get("metrics"), "clusters_info": rep.get("clusters_info")}
    if probe.cuda:
        out["gpu_peak_mb"] = max((r.get("gpu_peak_mb") or 0) for r in stages)
    return out


def run_child(spec: dict, timeout: int = 3600) -> dict:
    cmd = [sys.executable, __file__, "--_child", json.dumps(spec)]
    log(f"  {spec['label']} ...")
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        log(r.stderr[-3000:])
        return {"label": spec["label"], "error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    log(f"  {spec['label']}: {res['verdict']}, peak {res['peak_mb']:.0f} MB, {time.time() - t:.0f} s")
    return res


# ------------------------------------------------------------------------------------------------ fixtures


def fixture_specs(work: Path, quick: bool) -> list[dict]:
    specs = []

    def add(shape, label, rows, **kw):
        specs.append({"kind": "shape", "shape": shape, "label": f"{shape}/{label}", "rows": rows,
                      "run_dir": str(work / "fixtures" / shape / label), **kw})

    s, q = "smollm-135m", "qwen2.5-0.5b-width"
    add(s, "defaults", 64)
    add(s, "nf4", 64, quantization="nf4")
    if not quick:
        add(s, "projection_8192", 64, sets=["grads.projection_dim=8192"])
        add(s, "float16", 64, sets=["grads.storage_dtype=float16"])
        add(s, "rows_32", 32)
        add(s, "rows_128", 128)
        add(s, "exact", 64, sets=["grads.projection_dim=null"])
        add(s, "projection_1024", 64, sets=["grads.projection_dim=1024"])
        add(q, "defaults", 24)
        add(q, "projection_8192", 24, sets=["grads.projection_dim=8192"])
        add(q, "float16", 24, sets=["grads.storage_dtype=float16"])
        add(q, "nf4", 24, quantization="nf4")
    return specs


def smoke_fixture(work: Path) -> list[dict]:
    """--smoke's one fixture: bench/gpu_check.py's toy Llama shape (built in seconds, cached), 64 rows."""
    from gradian.demo.shapes import ShapeSpec

    shape = ShapeSpec("smoke-llama", "llama", 128, 384, 4, 4, 2, 8192, True, max_position=2048)
    return [{"kind": "shape", "shape_spec": dataclasses.asdict(shape), "label": "smoke-llama/defaults", "rows": 64,
             "run_dir": str(work / "fixtures" / "smoke-llama" / "defaults")}]


def acceptance_peak(res: dict) -> dict:
    bar = 3 * res["model_bytes"] / 2**20 + 3 * 1024
    return {"peak_mb": res["peak_mb"], "bar_mb": round(bar, 1), "ok": res["verdict"] == "attributed"
            and res["peak_mb"] < bar}


def stage_rows(res: dict) -> list[list]:
    return [[r["stage"], r["calls"], r["cpu_s"], r["peak_mb"], r["growth_mb"], r["tokens"], r["tokens_per_cpu_s"]]
            for r in res["stages"]]


def linear_in_rows(small: dict, large: dict, *, independent: list[str]) -> dict:
    """Per stage: growth of the peak above the stage's start (MB) and CPU seconds at two row counts, and whether
    each grows at most linearly in rows (x the row ratio, + 64 MB / 1 s of slack for fixed costs) and, for the
    stages that must not depend on rows, stays within 25 % + 64 MB."""
    ratio = large["rows"] / max(small["rows"], 1)
    a = {r["stage"]: r for r in small["stages"]}
    b = {r["stage"]: r for r in large["stages"]}
    out = {}
    for st in b:
        if st not in a:
            continue
        ga, gb, ta, tb = a[st]["growth_mb"], b[st]["growth_mb"], a[st]["cpu_s"], b[st]["cpu_s"]
        lin_mem = gb <= ratio * max(ga, 0) + 64
        lin_t = tb <= ratio * ta + 1.0
        flat = gb <= 1.25 * max(ga, 0) + 64 if st in independent else None
        out[st] = {"growth_mb": [ga, gb], "cpu_s": [ta, tb], "linear_memory": lin_mem, "linear_time": lin_t,
                   "rows_independent_memory": flat}
    return {"rows": [small["rows"], large["rows"]], "ratio": ratio, "stages": out}


# ------------------------------------------------------------------------------------------------ rows


def rows_run(work: Path, n: int, train_sets: tuple[str, ...] = ()) -> tuple[dict, Path]:
    """A run dir of the demo world with n training rows: the demo scenario's 300 rows (its eval set and planted
    facts) and n - 300 unique chat rows of the same world; the scenario's adapter, trained once (`train_sets`:
    recipe overrides, e.g. fewer epochs for a smoke run)."""
    import random

    from gradian.config import load_config
    from gradian.demo.run import prepare_demo
    from gradian.demo.tiny import TinySpec
    from gradian.demo.world import World
    from gradian.training.loop import train_adapter
    from gradian.training.recipe import read_recipe

    base_run = work / "rows" / "scenario"
    cfg_path = prepare_demo(base_run, progress=False)
    cfg = load_config(cfg_path, ["train.save_checkpoints=false", *train_sets])
    if read_recipe(base_run / "adapter") is None:
        log("  training the demo scenario's adapter ...")
        train_adapter(cfg, progress=False)
    world = World.generate(seed=TinySpec().seed, n_entities=TinySpec().n_entities)
    rng = random.Random(f"gradian-scale-rows-{n}")
    train = [json.loads(x) for x in (base_run / "train.jsonl").read_text().splitlines()]
    pairs = world.fact_pairs()
    seen = {json.dumps(r, sort_keys=True) for r in train}
    while len(train) < n:
        e, a = rng.choice(pairs)
        q = world.question(e, a, rng.randrange(world.n_phrasings))
        r = {"messages": [{"role": "user", "content": q + " " + world.filler_sentence(rng)},
                          {"role": "assistant", "content": world.value(e, a)}]}
        k = json.dumps(r, sort_keys=True)
        if k not in seen:
            seen.add(k)
            train.append(r)
    d = work / "rows" / f"n{n}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    import yaml

    c = yaml.safe_load(cfg_path.read_text())
    c["model"]["base"] = str(cfg.path(cfg.model.base))
    c["model"]["adapter"] = str(base_run / "adapter")
    c["data"] = {"train": "train.jsonl", "eval": str(base_run / "eval.jsonl")}
    c["output"] = "out"
    (d / "gradian.yaml").write_text(yaml.safe_dump(c, sort_keys=False))
    return {"config": str(d / "gradian.yaml"), "base": c["model"]["base"]}, d


# ------------------------------------------------------------------------------------------------ estimates


def estimates(rows: int = 10_000, batch: int = 8, seq: int = 512, queries: int = 8) -> list[dict]:
    """Per meta shape: the sizes each stage holds, from the formulas the code uses (no weights)."""
    from gradian.attribution.directions import DIRECTION_BYTES, block_size
    from gradian.checks.estimates import param_estimate
    from gradian.demo.shapes import META_SHAPES, meta_model, shape_config
    from gradian.explain.clusters import POOL_MAX, SKETCH_DIM
    from gradian.grads.layout import site_shapes
    from gradian.projection import AUTO_WIDTH, choose_projection
    from gradian.projection.data_aware import FIT_GRAM_BYTES, GRAM_MAX_D, STAGE2_WIDTH
    from gradian.setup.model import lora_sites
    from gradian.store.build import SHARD_BYTES

    out = []
    for name, spec in META_SHAPES.items():
        sites, _ = lora_sites(meta_model(spec))
        shapes = site_shapes(sites)
        exact = sum(s.numel for s in shapes)
        choice = choose_projection("auto", exact, rows)
        dim = choice.dim or exact
        params = param_estimate(shape_config(spec))
        # data-aware fit state (projection.data_aware.BasisFitter / SideFit rules)
        wide, stage2 = [], 0
        for s in shapes:
            k1 = max(1, STAGE2_WIDTH // s.r)
            for d in (s.d_in, s.d_out):
                stage2 += 8 * (s.r * min(d, k1)) ** 2
                if min(d, k1) < d:
                    wide.append((d, min(d, k1)))
        grams = sum(8 * d * d for d, _ in wide if d <= GRAM_MAX_D)
        up_to = GRAM_MAX_D if grams <= FIT_GRAM_BYTES else 0
        stage1 = sum(8 * d * d if d <= max(up_to, 2 * max(4 * k, 128)) else 4 * 2 * max(4 * k, 128) * d
                     for d, k in wide)
        widest_site = max(s.numel for s in shapes)
        vocab = spec.vocab
        e = {"shape": name, "params": params, "sites": len(shapes), "exact_width": exact,
             "exact_bytes_per_row": 4 * exact, "auto": choice.describe(), "rows": rows,
             "model_gb": {"bf16": round(params * 2 / GiB, 2), "fp32": round(params * 4 / GiB, 2),
                          "nf4": round((params - vocab * spec.hidden * (1 if spec.tied else 2)) * 0.5 / GiB
                                       + vocab * spec.hidden * (1 if spec.tied else 2) * 2 / GiB, 2)},
             "stages_mb": {
                 # capture: one site's per-example gradients at a time, the [batch, dim] output, the chunked loss
                 "index_capture": round((batch * 4 * widest_site + batch * 4 * dim + 1024 * vocab * 4 * 4) / 2**20),
                 "fit_state": round(max(stage1, stage2) / 2**20),
                 "index_write_buffer": round(min(SHARD_BYTES, 256 * 4 * dim) / 2**20),
                 "precondition_diagonal": round(8 * dim / 2**20),
                 "score": round((queries * rows * 8 + 256 * 2**20) / 2**20),
                 "rerank_directions": round(min(DIRECTION_BYTES, queries * 4 * exact) / 2**20),
                 "rerank_capture": round(batch * 4 * (exact + widest_site) / 2**20),
                 "clusters": round((POOL_MAX * SKETCH_DIM * 4 + 256 * 2**20) / 2**20),
                 "index_on_disk": round(rows * 4 * dim / 2**20),
             },
             "direction_block_items": block_size(exact), "auto_width": AUTO_WIDTH}
        out.append(e)
    return out


# ------------------------------------------------------------------------------------------------ quantized


def quantized_reference(work: Path) -> dict:
    """NF4 (and int8) capture against the naive one-example-per-backward reference through the same quantized model
    (a 2-layer Llama of hidden 64, LoRA r 4 on all 7 projections, random B), per site: the worst relative error."""
    import torch
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradian.config import config_from_dict
    from gradian.demo.shapes import lora_config
    from gradian.grads.capture import GradientCapture
    from gradian.grads.objectives import naive_per_example_loss
    from gradian.setup.model import load_model, lora_sites

    d = work / "quant"
    base, adapter = d / "base", d / "adapter"
    if not (adapter / "adapter_config.json").exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(base)
        from transformers import AutoModelForCausalLM

        m = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora_config(4))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        m.save_pretrained(adapter)
    g = torch.Generator().manual_seed(1)
    lengths = [12, 7, 15, 9]
    T = max(lengths)
    ids = torch.zeros(4, T, dtype=torch.long)
    attn = torch.zeros(4, T, dtype=torch.long)
    sup = torch.zeros(4, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 256, (n,), generator=g)
        attn[i, :n] = 1
        sup[i, n // 3 : n] = True
    out = {}
    for q in ("nf4", "int8"):
        model = load_model(config_from_dict({"model": {"base": str(base), "adapter": str(adapter), "device": "cpu",
                                                       "quantization": q}, "data": {"train": "t"}}))
        sites, _ = lora_sites(model)
        vecs, _ = GradientCapture(model, sites).vectors(ids, attn, sup)
        ref = []
        for i, n in enumerate(lengths):
            model.zero_grad(set_to_none=True)
            naive_per_example_loss(model(input_ids=ids[i : i + 1, :n]).logits, ids[i : i + 1, :n],
                                   sup[i : i + 1, :n]).sum().backward()
            ref.append(torch.cat([torch.cat([s.A.weight.grad.flatten(), s.B.weight.grad.flatten()]) for s in sites]))
        ref = torch.stack(ref)
        worst, off = 0.0, 0
        for s in sites:
            a, b = vecs[:, off : off + s.numel], ref[:, off : off + s.numel]
            worst = max(worst, float((a - b).norm() / b.norm()))
            off += s.numel
        out[q] = {"sites": len(sites), "worst_site_rel_error": worst, "target": 1e-4, "ok": worst < 1e-4,
                  "base_layer": type(model.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__}
    return out


# ------------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="*", default=["fixtures", "rows", "quant", "estimates"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="fixture labels (comma list of prefixes) to run")
    ap.add_argument("--rows", default="20000,100000", help="row counts of the rows scaling")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "gradian-scale-bench"))
    ap.add_argument("--smoke", action="store_true",
                    help="every section at toy sizes: one fixture (a toy Llama shape, 64 rows), the demo world at 320 "
                         "rows (three training epochs), quant and estimates; checks the script, in seconds")
    ap.add_argument("--_child", dest="child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    work = Path(args.work)
    if args.smoke:
        from _smoke import work_dir

        work, args.what, args.rows = work_dir("scale_bench"), ["fixtures", "rows", "quant", "estimates"], "320"
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {"schema": "gradian.bench.scale/1", "quick": args.quick, "smoke": args.smoke}
    text = []
    t_all = time.time()
    if "fixtures" in args.what:
        log("fixtures:")
        pick = [p for p in args.only.split(",") if p]
        specs = smoke_fixture(work) if args.smoke else fixture_specs(work, args.quick)
        res = [run_child(sp) for sp in specs if not pick or any(sp["label"].startswith(p) for p in pick)]
        out["fixtures"] = res
        rows = []
        for r in res:
            if "error" in r:
                rows.append([r["label"], "ERROR", r["error"][:60]] + [""] * 8)
                continue
            acc = acceptance_peak(r)
            pc = r["projection_choice"] or {}
            rows.append([r["label"], r["verdict"], r["rows"], pc.get("dim"), round(r["model_bytes"] / 2**20),
                         r.get("model_footprint_mb"), r["peak_mb"], acc["bar_mb"], acc["ok"], r["bytes_per_row"],
                         r["index_cpu_s_per_row"], r["cpu_s"]])
        text.append(table("fixtures: attribute end to end (peak RSS of the whole run; bar = 3 x model bytes + 3 GB; "
                          "footprint = the loaded model's parameters and buffers)",
                          ["run", "verdict", "rows", "dim", "model_MB", "footprint_MB", "peak_MB", "bar_MB", "ok",
                           "bytes/row", "index_cpu_s/row", "cpu_s"], rows))
        for r in res:
            if "error" not in r:
                text.append(table(f"stages of {r['label']}", ["stage", "calls", "cpu_s", "peak_MB", "growth_MB",
                                                               "tokens", "tokens/cpu_s"], stage_rows(r)))
        by = {r["label"]: r for r in res if "error" not in r}
        lin = {}
        for a, b in [("smollm-135m/rows_32", "smollm-135m/rows_128")]:
            if a in by and b in by:
                lin[f"{a} -> {b}"] = linear_in_rows(by[a], by[b], independent=ROWS_INDEPENDENT)
        out["fixtures_rows_scaling"] = lin
        out["fixtures_acceptance"] = {r["label"]: acceptance_peak(r) for r in res if "error" not in r}
    if "rows" in args.what:
        log("rows:")
        ns = [int(x) for x in args.rows.split(",")]
        res = []
        for n in ns:
            spec, d = rows_run(work, n, ("train.epochs=3",) if args.smoke else ())
            res.append(run_child({"kind": "config", "label": f"demo-world/{n}", "run_dir": str(d), **spec},
                                 timeout=7200))
        out["rows"] = res
        good = [r for r in res if "error" not in r]
        for r in good:
            size = f"{r['index_bytes'] / 2**20:.0f} MiB" if r["index_bytes"] is not None else f"none: {r['verdict']}"
            text.append(table(f"stages of {r['label']} (dim {r['index_dim']}, index {size})",
                              ["stage", "calls", "cpu_s", "peak_MB", "growth_MB", "tokens", "tokens/cpu_s"],
                              stage_rows(r)))
        if len(good) >= 2:
            lin = linear_in_rows(good[0], good[-1], independent=ROWS_INDEPENDENT)
            checks = []
            for r in good:
                by = {s["stage"]: s for s in r["stages"]}
                build = r["index_build_cpu_s"]
                after = {st: by[st]["cpu_s"] for st in AFTER_INDEX if st in by}
                checks.append({"rows": r["rows"], "index_build_cpu_s": build, "after_index_cpu_s": after,
                               "every_stage_after_index_cheaper": all(v < build for v in after.values())})
            lin["under_index_build"] = checks
            out["rows_scaling"] = lin
            text.append(table(f"rows {lin['rows'][0]} -> {lin['rows'][1]} (x{lin['ratio']:.0f}): growth of each stage",
                              ["stage", "growth_MB", "cpu_s", "linear mem", "linear time", "rows-independent mem"],
                              [[st, f"{v['growth_mb'][0]:.0f} -> {v['growth_mb'][1]:.0f}",
                                f"{v['cpu_s'][0]:.1f} -> {v['cpu_s'][1]:.1f}", v["linear_memory"], v["linear_time"],
                                v["rows_independent_memory"]] for st, v in lin["stages"].items()]))
            text.append(table("every stage after the index costs less than the index build",
                              ["rows", "index_build_cpu_s", "largest after-index stage", "ok"],
                              [[c["rows"], c["index_build_cpu_s"],
                                max(c["after_index_cpu_s"].items(), key=lambda kv: kv[1]),
                                c["every_stage_after_index_cheaper"]] for c in checks]))
    if "quant" in args.what:
        q = quantized_reference(work)
        out["quantized_reference"] = q
        text.append(table("quantized capture vs the naive one-example-per-backward reference, same quantized model",
                          ["quantization", "base layer", "sites", "worst site rel. error", "< 1e-4"],
                          [[k, v["base_layer"], v["sites"], f"{v['worst_site_rel_error']:.2e}", v["ok"]]
                           for k, v in q.items()]))
    if "estimates" in args.what:
        est = estimates()
        out["estimates"] = est
        keys = list(est[0]["stages_mb"])
        text.append(table(f"estimates on the meta device ({est[0]['rows']} rows, batch 8 x 512 tokens, 8 items; MB "
                          "per stage, model GB separately)",
                          ["shape", "params", "exact_width", "auto dim", "bf16_GB", "nf4_GB"] + keys,
                          [[e["shape"], e["params"], e["exact_width"], e["auto"]["dim"], e["model_gb"]["bf16"],
                            e["model_gb"]["nf4"]] + [e["stages_mb"][k] for k in keys] for e in est]))
    out["seconds"] = round(time.time() - t_all, 1)
    print("\n\n".join(text))
    print(json.dumps(out, separators=(",", ":"), default=str))
    errors = [r["label"] for r in out.get("fixtures", []) + out.get("rows", []) if "error" in r]
    if errors and args.smoke:  # a full run reports a failed run in its table and goes on; a smoke run must fail
        log(f"failed: {', '.join(errors)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
