"""Distributed benchmark (a measurement, not a test): the demo world's index built by 1 and by 2 processes.

    .venv/bin/python bench/distributed_bench.py [--rows 4000] [--work DIR] [--nproc 2]
    .venv/bin/python bench/distributed_bench.py --smoke    # the same on bench/_smoke.py's 48-row tiny scenario

The demo world with `--rows` training rows (the demo scenario's 300 first, then unique chat rows of the same world;
`bench/scale_bench.py rows_run`), its scenario adapter; `gradian index` run by one process and by `torchrun
--nproc-per-node N` (gloo, one thread per process), each into a fresh index directory, then `gradian attribute` on
each index (reused, no capture). Printed: the index build's seconds and rows/s (wall: the ranks run side by side,
so wall time is what N processes buy; CPU seconds of all processes beside it), the speedup, and whether the two
runs' scores.npy agree bit for bit and the two indexes hold the same vectors. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
ENV = {"GRADIAN_THREADS": "1", "OMP_NUM_THREADS": "1", "GRADIAN_PROGRESS": "0"}


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def gradian(args: list[str], nproc: int) -> tuple[subprocess.CompletedProcess, float, float]:
    """(process, wall s, CPU s of every process it started)."""
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "gradian"]
    else:
        head = [sys.executable, "-m", "gradian"]
    c0, t0 = _cpu_children(), time.time()
    p = subprocess.run([*head, *args], capture_output=True, text=True, env={**os.environ, **ENV})
    wall, cpu = time.time() - t0, _cpu_children() - c0
    if p.returncode != 0:
        raise SystemExit(f"gradian {' '.join(args)} (nproc {nproc}) failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p, wall, cpu


def vectors(cache: Path) -> dict:
    (root,) = [d for d in cache.iterdir() if d.is_dir()]
    m = json.loads((root / "manifest.json").read_text())
    out = {}
    for s in m["shards"]:
        block = np.load(root / s["file"])
        out.update({k: block[i] for i, k in enumerate(s["keys"])})
    return out, sorted({s.get("origin", "one process") for s in m["shards"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gradian-bench")
    ap.add_argument("--smoke", action="store_true",
                    help="bench/_smoke.py's tiny scenario (48 rows) instead of the demo world: checks the script")
    a = ap.parse_args()
    os.environ.update(ENV)
    if a.smoke:
        from _smoke import tiny_run

        d = tiny_run()
        cfg, a.rows = str(d / "gradian.yaml"), 48
    else:
        from scale_bench import rows_run

        spec, d = rows_run(a.work, a.rows)
        cfg = spec["config"]
    sets = ["--set", "attribution.checkpoints=1"]
    res: dict = {"bench": "distributed", "schema": "gradian.bench.distributed/1", "rows": a.rows, "smoke": a.smoke,
                 "runs": {}}
    for n in (1, a.nproc):
        cache = d / f"ix-{n}"
        shutil.rmtree(cache, ignore_errors=True)
        p, wall, cpu = gradian(["index", cfg, *sets, "--set", f"grads.cache_dir={cache}"], n)
        text = " ".join(p.stdout.split())
        secs = float(re.search(r"\s([0-9.]+) s, ([0-9.]+) rows/s", text).group(1))
        built = int(re.search(r"built (\d+)", text).group(1))
        q, awall, acpu = gradian(["attribute", cfg, *sets, "--set", f"grads.cache_dir={cache}", "--set",
                                  f"output=out-{n}"], n)
        rep = json.loads((d / f"out-{n}" / "report.json").read_text())
        res["runs"][n] = {"index_seconds": secs, "built": built, "rows_per_s": round(built / secs, 1),
                          "index_command_wall_s": round(wall, 1), "index_command_cpu_s": round(cpu, 1),
                          "attribute_wall_s": round(awall, 1), "attribute_cpu_s": round(acpu, 1),
                          "attribute_built_rows": rep["index"]["built_rows"], "verdict": rep["verdict"]}
    one, many = res["runs"][1], res["runs"][a.nproc]
    v1, _ = vectors(d / "ix-1")
    vn, origins = vectors(d / f"ix-{a.nproc}")
    res["speedup"] = round(one["index_seconds"] / many["index_seconds"], 2)
    res["scores_bitwise_equal"] = bool(np.array_equal(np.load(d / "out-1" / "scores.npy"),
                                                      np.load(d / f"out-{a.nproc}" / "scores.npy")))
    res["vectors_bitwise_equal"] = v1.keys() == vn.keys() and all(np.array_equal(v1[k], vn[k]) for k in v1)
    res["shard_origins"] = origins
    print(f"{'processes':>9s} {'rows':>6s} {'index s':>8s} {'rows/s':>7s} {'index CPU s':>11s} "
          f"{'attribute s':>11s} {'attribute CPU s':>15s}")
    for n, r in res["runs"].items():
        print(f"{n:9d} {r['built']:6d} {r['index_seconds']:8.1f} {r['rows_per_s']:7.1f} {r['index_command_cpu_s']:11.1f} "
              f"{r['attribute_wall_s']:11.1f} {r['attribute_cpu_s']:15.1f}")
    print(f"speedup of the index build, {a.nproc} processes over 1: {res['speedup']:.2f}x; scores.npy bit for bit "
          f"{'equal' if res['scores_bitwise_equal'] else 'DIFFERENT'}; index vectors "
          f"{'equal' if res['vectors_bitwise_equal'] else 'DIFFERENT'}; shards written by {', '.join(origins)}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
