"""Equivalence of two revisions: the same report.json (timings and the keys listed with --ignore aside), scores.npy and trained adapters.

    .venv/bin/python bench/equivalence.py --before REV            # REV against the working tree
    .venv/bin/python bench/equivalence.py --before REV --quick    # the demo and its variants only
    .venv/bin/python bench/equivalence.py --smoke                 # the working tree against itself, on the tiny
                                                                  # scenario of bench/_smoke.py (checks the harness)

A refactor is proven by equivalence. For each run below, the scenario is written and its adapter trained once
with the BEFORE code; then `python -m gradian attribute` runs on the very same directory with the BEFORE code and
with the AFTER code (the working tree), each from an empty index cache, and the outputs are compared: report.json
parsed, with `timings` removed, must be equal; scores.npy and scores_total.npy must be equal byte for byte. The
adapter is also trained a second time with the AFTER code and compared tensor by tensor (bit for bit), with its
recipe and saved epoch checkpoints (`adapter_diffs`, shared with `bench/equivalence_validate.py`).

Runs: the demo (substitution, seed 0) with the default settings and with each other preconditioner, a projected
index (data-aware 1024, exact re-ranking and the self-check), float16 storage, and attribution.checkpoints: 8
(replayed) and 1; then every `bench/fidelity.py --quick` scenario (conversation4, conversation8, buried, cluster,
format: seed 0; null: seeds 0-3) with its defaults.

The BEFORE code runs from a `git worktree` of REV (PYTHONPATH), the AFTER code from this checkout's `src`; both
in the same virtual environment, one CPU thread. Prints one line per run, then ONE JSON object as the last line, and
exits 1 on any difference. `--smoke` takes no revision: both sides are this checkout (no worktree), on one run of the
tiny scenario, so it checks the harness end to end and that a run is reproduced bit for bit; its BEFORE adapter is
the smoke's shared tiny run's (bench/_smoke.py `seed_from_tiny`), which the AFTER side's `gradian train` must
reproduce bit for bit.
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

ROOT = Path(__file__).resolve().parent.parent

DEMO_VARIANTS = {
    "default": [],
    "identity": ["attribution.preconditioner=identity"],
    "fisher": ["attribution.preconditioner=fisher"],
    "datainf": ["attribution.preconditioner=datainf"],
    "projected": ["grads.projection_dim=1024"],
    "float16": ["grads.storage_dtype=float16"],
    "ck8": ["attribution.checkpoints=8"],
    "ck1": ["attribution.checkpoints=1"],
}
SCENARIOS = [("conversation4", 0), ("conversation8", 0), ("buried", 0), ("cluster", 0), ("format", 0),
             ("null", 0), ("null", 1), ("null", 2), ("null", 3)]

PREPARE = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import fidelity as fb
name, seed, out = sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
if name == "substitution":
    from gradian.demo.run import prepare_demo
    d = out / f"{name}-s{seed}"
    cfg = prepare_demo(d, seed=seed, progress=False)
elif name == "tiny":
    from _smoke import write_tiny_scenario
    cfg = write_tiny_scenario(out / f"{name}-s{seed}", seed=seed)
else:
    _, d, cfg, _ = fb.prepare(name, seed, out)
print(cfg)
"""


def run(cmd: list[str], *, src: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src), "GRADIAN_THREADS": "1", "GRADIAN_PROGRESS": "0"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)


def checked(p: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if p.returncode != 0:
        sys.exit(f"{what} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def attribute(cfg: Path, sets: list[str], src: Path, dest: Path) -> float:
    """`gradian attribute` from an empty index cache; its outputs moved to `dest`; returns CPU seconds."""
    run_dir = cfg.parent
    out = run_dir / "eq-out"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(run_dir / "eq-index", ignore_errors=True)
    t0 = os.times()
    checked(run([sys.executable, "-m", "gradian", "attribute", str(cfg), "--set", "output=eq-out",
                 "--set", "grads.cache_dir=eq-index", *sum((["--set", s] for s in sets), [])], src=src),
            f"attribute {cfg} {sets} ({src})")
    t1 = os.times()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in ("report.json", "scores.npy", "scores_total.npy", "capability.json"):
        if (out / f).exists():
            shutil.copy2(out / f, dest / f)
    if (run_dir / "truth.json").exists():
        shutil.copy2(run_dir / "truth.json", dest / "truth.json")
    return (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system)


# Never compared: seconds differ from run to run.
ALWAYS_IGNORED = ("timings", "timings_cpu")


def _drop(report: dict, dotted: str) -> None:
    """Remove a dotted key path (`query.checkpoints.rule`) from a report, where present."""
    *head, last = dotted.split(".")
    node = report
    for k in head:
        node = node.get(k) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(last, None)


def compare(a: Path, b: Path, ignore: tuple = ()) -> list[str]:
    diffs = []
    ra = json.loads((a / "report.json").read_text())
    rb = json.loads((b / "report.json").read_text())
    for k in ALWAYS_IGNORED + tuple(ignore):
        _drop(ra, k)
        _drop(rb, k)
    if ra != rb:
        keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
        diffs.append(f"report.json differs in {keys}")
    for f in ("scores.npy", "scores_total.npy", "capability.json"):
        ea, eb = (a / f).exists(), (b / f).exists()
        if ea != eb:
            diffs.append(f"{f}: present {ea} vs {eb}")
        elif ea and (a / f).read_bytes() != (b / f).read_bytes():
            diffs.append(f"{f} differs")
    return diffs


def adapter_diffs(a: Path, b: Path) -> list[str]:
    """What differs between two trained adapters: their tensors (bit for bit), their recipes (less
    `train_seconds`) and, the same way, each saved `checkpoints/epoch-*`; empty when nothing does."""
    import torch
    from safetensors.torch import load_file

    diffs = []
    ta, tb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    if not (ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)):
        diffs.append("adapter tensors differ")
    ra, rb = (json.loads((d / "gradian_recipe.json").read_text()) for d in (a, b))
    for r in (ra, rb):
        r.pop("train_seconds", None)
    if ra != rb:
        diffs.append(f"recipes differ in {sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))}")
    for sub in sorted(p.name for p in (a / "checkpoints").glob("epoch-*")) if (a / "checkpoints").is_dir() else []:
        diffs += [f"checkpoints/{sub}: {d}" for d in adapter_diffs(a / "checkpoints" / sub, b / "checkpoints" / sub)]
    return diffs


def retrained_diffs(cfg: Path, src: Path) -> list[str]:
    """The run's adapter trained again with the code at `src` (into `adapter-after`, removed afterwards) against
    the one in the run directory (`adapter_diffs`)."""
    retrained = cfg.parent / "adapter-after"
    shutil.rmtree(retrained, ignore_errors=True)
    checked(run([sys.executable, "-m", "gradian", "train", str(cfg), "--set", f"train.output={retrained}"], src=src),
            f"train {cfg} ({src})")
    diffs = adapter_diffs(cfg.parent / "adapter", retrained)
    shutil.rmtree(retrained, ignore_errors=True)
    return diffs


def common_arguments(ap: argparse.ArgumentParser, work: str) -> None:
    """The options both equivalence benches take: --before, --work (default $TMPDIR/`work`), --reuse-before."""
    ap.add_argument("--before", help="git revision of the BEFORE code (required but with --smoke)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / work)
    ap.add_argument("--reuse-before", action="store_true",
                    help="keep the BEFORE outputs of an earlier run in --work (same REV) and rerun AFTER only")
    ap.add_argument("--smoke", action="store_true",
                    help="this checkout on both sides (no revision, no worktree), one tiny run: checks the harness")


def sides(args, ap: argparse.ArgumentParser, smoke_name: str) -> tuple[str, Path, Path]:
    """(revision, BEFORE checkout, work directory): `--before`'s worktree, or with --smoke this checkout itself and
    bench/_smoke.py's work directory."""
    if args.smoke:
        from _smoke import work_dir

        return "checkout", ROOT, work_dir(smoke_name)
    if not args.before:
        ap.error("--before REV is required (or --smoke)")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rev, path = before_checkout(args.before, work)
    return rev, path, work


def before_checkout(before: str, work: Path) -> tuple[str, Path]:
    """(the full revision of `before`, a `git worktree` of it under `work`, added once and reused)."""
    rev = checked(subprocess.run(["git", "rev-parse", before], capture_output=True, text=True, cwd=ROOT),
                  "git rev-parse").stdout.strip()
    path = work / f"before-{rev[:12]}"
    if not path.exists():
        checked(subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], capture_output=True,
                               text=True, cwd=ROOT), "git worktree add")
    return rev, path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(ap, "gradian-equivalence")
    ap.add_argument("--quick", action="store_true", help="the demo and its variants only")
    ap.add_argument("--ignore", action="append", default=[], metavar="KEY.PATH",
                    help="a report key changed on purpose (dotted, e.g. query.checkpoints.rule); repeatable")
    ap.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run on both sides (e.g. a default the AFTER code changed on "
                         "purpose, held at the BEFORE value); repeatable")
    args = ap.parse_args()
    rev, before_src, work = sides(args, ap, "equivalence")
    b_src, a_src = before_src / "src", ROOT / "src"
    runs: list[tuple[str, str, int, list[str]]] = [(f"demo-{v}", "substitution", 0, s) for v, s in
                                                     DEMO_VARIANTS.items()]
    if not args.quick:
        runs += [(f"{n}-s{seed}", n, seed, []) for n, seed in SCENARIOS]
    if args.smoke:
        runs = [("tiny-default", "tiny", 0, [])]
    if args.only:
        keep = set(args.only.split(","))
        runs = [r for r in runs if r[0] in keep]
    scen = work / "scenarios"
    cfgs: dict[tuple[str, int], Path] = {}
    bad = 0
    t_all = time.time()
    for label, name, seed, sets in runs:
        if (name, seed) not in cfgs:
            p = checked(run([sys.executable, "-c", PREPARE, str(before_src / "bench"), name, str(seed), str(scen)],
                            src=b_src), f"prepare {name} s{seed}")
            cfg = Path(p.stdout.strip().splitlines()[-1])
            if args.smoke:  # the tiny scenario's BEFORE adapter is bench/_smoke.py's tiny run's (same code, same data)
                from _smoke import seed_from_tiny

                seed_from_tiny(cfg.parent)
            if not (cfg.parent / "adapter" / "adapter_model.safetensors").exists():
                checked(run([sys.executable, "-m", "gradian", "train", str(cfg)], src=b_src), f"train {name}")
            diffs = retrained_diffs(cfg, a_src)
            print(f"train {name}-s{seed}: adapters {'identical' if not diffs else 'DIFFER: ' + '; '.join(diffs)}",
                  flush=True)
            bad += bool(diffs)
            cfgs[(name, seed)] = cfg
        cfg = cfgs[(name, seed)]
        dest_b, dest_a = work / "results" / "before" / label, work / "results" / "after" / label
        cpu_b = None
        sets = list(args.sets) + list(sets)
        if not (args.reuse_before and (dest_b / "report.json").exists()):
            cpu_b = attribute(cfg, sets, b_src, dest_b)
        cpu_a = attribute(cfg, sets, a_src, dest_a)
        diffs = compare(dest_b, dest_a, tuple(args.ignore))
        bad += bool(diffs)
        cpu = f"CPU {cpu_b:.1f}s -> {cpu_a:.1f}s" if cpu_b is not None else f"CPU (after) {cpu_a:.1f}s"
        print(f"{label}: {'identical' if not diffs else 'DIFFERENT: ' + '; '.join(diffs)} ({cpu})", flush=True)
    print(f"{len(runs)} runs, {bad} with differences, {time.time() - t_all:.0f} s wall")
    print(json.dumps({"bench": "equivalence", "before": rev, "smoke": args.smoke, "runs": len(runs),
                      "with_differences": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
