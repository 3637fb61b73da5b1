"""CLI startup benchmark (a measurement, not a test): how long `gradian --help` takes, and what importing
`gradian.cli` costs.

    .venv/bin/python bench/cli_startup.py              # median of 5 runs each (plus one unmeasured warm-up)
    .venv/bin/python bench/cli_startup.py --runs 9
    .venv/bin/python bench/cli_startup.py --smoke      # one run of each, no warm-up (make bench-smoke)

`gradian --help` runs as a subprocess: the `gradian` console script of this interpreter's environment if it is
installed (beside `sys.executable`, else on PATH), else `python -m gradian`. The import time is the cumulative
figure `python -X importtime -c "import gradian.cli"` reports for `gradian.cli`, in a fresh interpreter each run.
Prints two lines, then ONE JSON object as the last line (`"schema": "gradian.bench.cli_startup/1"`).
The target is a `--help` median under 1 s; tests/test_startup.py holds the behaviour behind it (no torch,
transformers or peft at import of `gradian.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def help_command() -> list[str]:
    beside = Path(sys.executable).parent / "gradian"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside), "--help"]
    found = shutil.which("gradian")
    if found:
        return [found, "--help"]
    return [sys.executable, "-m", "gradian", "--help"]


def wall_help(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr}")
    return dt


_IMPORT_LINE = re.compile(r"^import time:\s*(\d+)\s*\|\s*(\d+)\s*\|\s*gradian\.cli\s*$", re.M)


def import_cli_seconds() -> float:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", "import gradian.cli"], capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"import gradian.cli failed:\n{p.stderr}")
    m = _IMPORT_LINE.search(p.stderr)
    if not m:
        raise SystemExit("no `gradian.cli` line in the -X importtime output")
    return int(m.group(2)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="measured runs of each (default 5)")
    ap.add_argument("--smoke", action="store_true", help="one run of each and no warm-up: checks the script runs")
    a = ap.parse_args()
    if a.smoke:
        a.runs = 1
    cmd = help_command()
    if not a.smoke:
        wall_help(cmd)  # warm-up: page cache and .pyc files, not counted
    walls = [wall_help(cmd) for _ in range(a.runs)]
    imports = [import_cli_seconds() for _ in range(a.runs)]
    help_med, import_med = statistics.median(walls), statistics.median(imports)
    print(f"gradian --help: median {help_med:.3f} s of {a.runs} wall runs "
          f"(min {min(walls):.3f}, max {max(walls):.3f}) via {' '.join(cmd)}")
    print(f"import gradian.cli: median {import_med * 1000:.1f} ms (-X importtime, cumulative)")
    print(json.dumps({"schema": "gradian.bench.cli_startup/1", "command": cmd, "runs": a.runs,
                      "help_wall_s": {"median": round(help_med, 4), "all": [round(w, 4) for w in walls]},
                      "import_cli_s": {"median": round(import_med, 4), "all": [round(t, 4) for t in imports]},
                      "meets": {"help_under_1s": help_med < 1.0}, "smoke": a.smoke}))


if __name__ == "__main__":
    main()
