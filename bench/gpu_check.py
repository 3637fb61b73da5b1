"""The GPU check behind bench/gpu_check.sh: real shapes on one CUDA device in bf16 and nf4, in under 8 minutes.

    bench/gpu_check.sh                 # on a machine with one GPU
    bench/gpu_check.sh --cpu-smoke     # the same steps on CPU over small shapes (checks the script end to end)
    bench/gpu_check.sh --smoke         # --cpu-smoke cut to its first shape without nf4, one repetition (seconds;
                                       # make bench-smoke)

Steps (each in its own process, with a time limit):

1. `gradian attribute` with the defaults on the SmolLM-135M and Qwen2.5-0.5B-width shapes and a Llama-3.2-1B shape
   (random weights built on the machine, bf16), in bf16 and with `model.quantization: nf4`: verdict, seconds and
   peak GPU memory per stage, tokens/s per stage (`scale_bench` children with the stage probe).
2. Capture overhead on CUDA: wall seconds (synchronised) of the hooked capture, exact and with the default
   projection, over a plain forward+backward on the same batches (CPU time says nothing about a GPU).
3. The loss's logit upcast: peak GPU memory of forward+backward of the chunked LM-head loss against the naive fp32
   upcast, batch 8 x 512 supervised tokens x a 128,256-token vocabulary (the seed measured 2.1 GB for the latter).

The last line is one JSON object (`"schema": "gradian.bench.gpu_check/1"`).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GRADIAN_PROGRESS", "0")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def shapes(smoke: bool):
    from gradian.demo.shapes import LLAMA32_1B, QWEN25_05B_WIDTH, SMOLLM_135M, ShapeSpec

    if not smoke:
        return [SMOLLM_135M, QWEN25_05B_WIDTH, dataclasses.replace(LLAMA32_1B, dtype="bfloat16")]
    # the same families and code paths, small enough for a CPU in a few minutes
    return [ShapeSpec("smoke-llama", "llama", 128, 384, 4, 4, 2, 8192, True, max_position=2048),
            # seed 3: with seeds 0-2 this random model's greedy answer is white space for every prompt
            ShapeSpec("smoke-qwen2", "qwen2", 128, 512, 2, 4, 2, 16384, True, max_position=2048, seed=3)]


# ------------------------------------------------------------------------------------------------ children


def overhead_child(spec: dict) -> dict:
    """Wall seconds per pass (device synchronised) over the same batches: plain fwd+bwd vs the hooked captures."""
    import statistics

    import torch

    from gradian.config import load_config
    from gradian.demo.shapes import RunSpec, ShapeSpec, shape_run, write_shape_config
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.grads.objectives import per_example_loss
    from gradian.projection import AUTO_WIDTH, Projector
    from gradian.setup.batches import collate
    from gradian.setup.session import open_session

    dev = spec["device"]
    tmpl = shape_run(ShapeSpec(**spec["shape_spec"]), RunSpec(rows=64, device=dev, dtype=spec["dtype"]))
    d = Path(tempfile.mkdtemp(prefix="gradian-gpu-check-"))
    atexit.register(shutil.rmtree, d, True)  # the run's config and data, gone when the process ends
    s = open_session(load_config(write_shape_config(d, tmpl)), need_eval=False)
    sync = (lambda: torch.cuda.synchronize()) if dev.startswith("cuda") else (lambda: None)
    toks, pad, bs = s.toks, s.pad_id, 8
    order = sorted(range(len(toks)), key=lambda i: (len(toks[i].input_ids), i))
    data = [tuple(t.to(s.device) for t in collate([toks[i] for i in order[a : a + bs]], pad))
            for a in range(0, len(order), bs)]
    shapes_ = site_shapes(s.sites)
    exact = GradientCapture(s.model, s.sites, Projector(shapes_))
    proj = Projector(shapes_, AUTO_WIDTH, "data-aware")
    fit = proj.fitter()
    for _ in range(fit.passes):
        for ids, attn, sup in data:
            it, _ = exact.iter_site_grads(ids, attn, sup)
            for i, (dA, dB) in it:
                fit.update(i, dA, dB)
        fit.end_pass()
    proj.set_basis(fit.finish())
    caps = {"exact": exact, f"data-aware_{AUTO_WIDTH}": GradientCapture(s.model, s.sites, proj)}

    def plain():
        for ids, attn, sup in data:
            s.model.zero_grad(set_to_none=True)
            per_example_loss(s.model, ids, attn, sup).sum().backward()
        s.model.zero_grad(set_to_none=True)

    fns = {"plain": plain, **{k: (lambda c=c: [c.vectors(*d) for d in data]) for k, c in caps.items()}}
    times: dict = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(spec.get("reps", 5)):
        for k, f in fns.items():
            sync()
            t = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = int(sum(int(d[1].sum()) for d in data))
    return {"shape": spec["shape_spec"]["name"], "device": dev, "dtype": spec["dtype"], "batches": len(data),
            "tokens": tokens, "seconds": {k: round(v, 4) for k, v in med.items()},
            "ratio": {k: round(v / med["plain"], 3) for k, v in med.items() if k != "plain"},
            "tokens_per_s": {k: round(tokens / v, 1) for k, v in med.items()}}


def logits_child(spec: dict) -> dict:
    """Peak memory of the loss alone (forward + backward), chunked vs the naive fp32 upcast."""
    import torch

    from gradian.grads.lm_head import chunked_head_loss
    from gradian.grads.objectives import supervised_positions

    dev = torch.device(spec["device"])
    B, T, V, H = spec["batch"], spec["tokens"], spec["vocab"], spec["hidden"]
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    ids = torch.randint(0, V, (B, T + 1), generator=g).to(dev)
    sup = torch.ones(B, T + 1, dtype=torch.bool, device=dev)
    hidden0 = torch.randn(B, T + 1, H, generator=g).to(dev, torch.bfloat16)
    out = {}
    for kind in ("naive", "chunked"):
        hidden = hidden0.clone().requires_grad_(True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        if kind == "naive":
            logits = (hidden @ weight.T).float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1),
                                                     reduction="sum")
        else:
            b, pp, tp = supervised_positions(sup)
            loss = chunked_head_loss(hidden[b, pp], weight, None, ids[b, tp], chunk=spec["chunk"]).sum()
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            out[kind] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        else:
            out[kind] = None
        del hidden, loss
    return {"batch": B, "tokens": T, "vocab": V, "chunk": spec["chunk"], "peak_mb": out,
            "ratio": round(out["chunked"] / out["naive"], 3) if out["naive"] else None}


DEADLINE = [float("inf")]  # wall-clock time by which every step must have ended (the script's budget)


def run(kind: str, spec: dict, timeout: int) -> dict:
    """One step in its own process, within `timeout` and the remaining budget (a step that cannot start in time
    is skipped, so the script always ends with its JSON line)."""
    left = DEADLINE[0] - time.time()
    if left < 20:
        return {"error": "skipped: the time budget is spent"}
    timeout = int(min(timeout, left))
    cmd = [sys.executable, __file__, "--_child", kind, json.dumps(spec)]
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if r.returncode != 0:
        log(r.stderr[-2000:])
        return {"error": f"exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}"}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["process_seconds"] = round(time.time() - t, 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="run every step on CPU over small shapes")
    ap.add_argument("--smoke", action="store_true",
                    help="--cpu-smoke on its first shape alone, without nf4, one repetition: checks the script")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "gradian-gpu-check"))
    ap.add_argument("--budget", type=int, default=None, help="seconds for every step together (default 450 on a "
                    "GPU: under the 8 minutes, 1500 for --cpu-smoke)")
    ap.add_argument("--_child", dest="child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, spec = args.child[0], json.loads(args.child[1])
        if kind == "attribute":
            from scale_bench import child

            print(json.dumps(child(spec)))
        else:
            print(json.dumps({"overhead": overhead_child, "logits": logits_child}[kind](spec)))
        return 0
    import torch

    smoke = args.cpu_smoke or args.smoke
    if not smoke and not torch.cuda.is_available():
        log("no CUDA device: run with --cpu-smoke to check the script on CPU")
        return 2
    device = "cpu" if smoke else "cuda"
    work = Path(args.work)
    if args.smoke:
        from _smoke import work_dir

        work = work_dir("gpu_check")
    mode = "smoke" if args.smoke else "cpu-smoke" if smoke else "gpu"
    out: dict = {"schema": "gradian.bench.gpu_check/1", "mode": mode, "device": device,
                 "gpu": None if smoke else torch.cuda.get_device_name(0), "attribute": [], "overhead": []}
    t0 = time.time()
    DEADLINE[0] = t0 + (args.budget or (1500 if smoke else 450))
    failed = False
    todo = shapes(smoke)[:1] if args.smoke else shapes(smoke)
    for sh in todo:
        for quant in ("none",) if args.smoke else ("none", "nf4"):
            label = f"{sh.name}/bf16" + ("+nf4" if quant == "nf4" else "")
            log(f"attribute {label} ...")
            spec = {"kind": "shape", "shape_spec": dataclasses.asdict(sh), "label": label, "rows": 64,
                    "quantization": quant, "device": device, "dtype": "bfloat16",
                    "run_dir": str(work / sh.name / quant)}
            res = run("attribute", spec, 240 if not smoke else 900)
            failed |= "error" in res or res.get("verdict") != "attributed"
            res.setdefault("label", label)
            out["attribute"].append(res if "error" in res else {
                k: res[k] for k in ("label", "verdict", "rows", "peak_mb", "gpu_peak_mb", "cpu_s", "wall_s",
                                    "index_dim", "bytes_per_row", "projection_choice", "stages", "process_seconds")
                if k in res})
            log(f"  {label}: {res.get('verdict', res.get('error'))} in {res.get('process_seconds')} s")
    for sh in todo[:: 2]:
        log(f"overhead {sh.name} ...")
        res = run("overhead", {"shape_spec": dataclasses.asdict(sh), "device": device, "dtype": "bfloat16",
                               "reps": 1 if args.smoke else 3 if smoke else 5}, 240 if not smoke else 900)
        failed |= "error" in res
        res.setdefault("shape", sh.name)
        out["overhead"].append(res)
    log("logit upcast ...")
    big = {"batch": 8, "tokens": 512, "vocab": 128256, "hidden": 2048, "chunk": 1024}
    small = {"batch": 2, "tokens": 64, "vocab": 8192, "hidden": 64, "chunk": 32}
    res = run("logits", {**(small if smoke else big), "device": device}, 240)
    failed |= "error" in res
    out["logits"] = res
    out["seconds"] = round(time.time() - t0, 1)
    out["ok"] = not failed
    for r in out["attribute"]:
        log(f"{r.get('label')}: {r.get('verdict', r.get('error'))}, peak RSS {r.get('peak_mb')} MB, "
            f"peak GPU {r.get('gpu_peak_mb')} MB, {r.get('wall_s')} s")
    for r in out["overhead"]:
        log(f"overhead {r.get('shape')}: {r.get('ratio', r.get('error'))}, tokens/s {r.get('tokens_per_s')}")
    log(f"logit upcast: {out['logits']}")
    print(json.dumps(out, separators=(",", ":"), default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
