"""Equivalence of two revisions for the validation verbs: the same verify.json and fidelity.json, the same adapters.

    .venv/bin/python bench/equivalence_validate.py --before REV                 # REV against the working tree
    .venv/bin/python bench/equivalence_validate.py --before REV --reuse-before  # rerun the AFTER side only
    .venv/bin/python bench/equivalence_validate.py --smoke      # this checkout against itself: tiny-hf, smaller
                                                                # verify and fidelity (checks the harness)

What `bench/equivalence.py` does for `attribute`, this does for `verify`, `fidelity` and the trainers. Each run's
scenario is written, its adapter trained and `attribute` run once with the BEFORE code, so both sides read the very
same report.json and scores.npy; then `python -m gradian verify` and `python -m gradian fidelity` run in that
directory with the BEFORE code and with the AFTER code (this checkout's `src`), and their outputs are compared:
verify.json and fidelity.json parsed, with every timing removed (`timings`, and `train_seconds` / `eval_seconds`
of each retrain), must be equal. The adapter is also trained again with the AFTER code and compared with the
BEFORE one tensor by tensor (bit for bit), and so is its recipe (less `train_seconds`).

Runs: the tiny verify scenario of the tests (`tests/test_verify.write_tiny_run`: 48 chat rows, 4 planted) with
gradian's loop (`train.backend: hf`) and with TRL's SFTTrainer (`train.backend: trl`), and the demo (substitution,
seed 0). verify: --controls 2 with the report's default K; fidelity: --loo 2 --subsets 4 with the identity and
diagonal preconditioners.

BEFORE runs from a `git worktree` of REV (PYTHONPATH), AFTER from this checkout; same virtual environment, one CPU
thread. Prints one line per comparison, then ONE JSON object as the last line, and exits 1 on any difference.
`--smoke`: no revision, this checkout on both sides (as `bench/equivalence.py --smoke`), the tiny-hf run only, verify
with --controls 1 --top-k 2 and fidelity with --loo 1 --subsets 2 and the identity preconditioner, and no second
training (the adapter comparison is bench/equivalence.py's, which its own smoke runs). The tiny-hf run is
bench/_smoke.py's tiny scenario, so its adapter and report come from the smoke's shared tiny run (`seed_from_tiny`)
and the BEFORE side's `train` and `attribute` are skipped as with files already there; the scenario is still
written by the BEFORE side's prepare step.
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

from equivalence import ROOT, checked, common_arguments, retrained_diffs, run, sides  # bench/ is sys.path[0]

PREPARE = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
name, out = sys.argv[2], Path(sys.argv[3])
if name == "demo":
    from gradian.demo.run import prepare_demo
    print(prepare_demo(out / name, seed=0, progress=False))
else:
    from test_verify import write_tiny_run
    train = {"backend": "trl"} if name == "tiny-trl" else None
    print(write_tiny_run(out / name, train=train))
"""
RUNS = ("tiny-hf", "tiny-trl", "demo")
VERIFY_ARGS = ["--controls", "2"]
FIDELITY_ARGS = ["--loo", "2", "--subsets", "4", "--preconditioner", "identity", "--preconditioner", "diagonal"]
SMOKE_VERIFY_ARGS = ["--controls", "1", "--top-k", "2"]
SMOKE_FIDELITY_ARGS = ["--loo", "1", "--subsets", "2", "--preconditioner", "identity"]
RETRAIN_TIMINGS = ("train_seconds", "eval_seconds")


def gradian(cfg: Path, verb: str, args: list[str], src: Path) -> subprocess.CompletedProcess:
    return checked(run([sys.executable, "-m", "gradian", verb, str(cfg), *args], src=src), f"{verb} {cfg} ({src})")


def without_timings(doc: dict) -> dict:
    """The document less what a clock decides: `timings`, and each retrain's train/eval seconds."""
    doc = json.loads(json.dumps(doc))
    doc.pop("timings", None)
    for part in [doc.get("accused")] + list(doc.get("controls") or []):
        if isinstance(part, dict):
            for k in RETRAIN_TIMINGS:
                part.pop(k, None)
    return doc


def validate(cfg: Path, verb: str, args: list[str], src: Path, dest: Path) -> float:
    """`gradian VERB` in the run directory; its JSON moved to `dest`; returns the CPU seconds it took."""
    out = cfg.parent / f"{verb}.json"
    out.unlink(missing_ok=True)
    t0 = os.times()
    gradian(cfg, verb, args, src)
    t1 = os.times()
    dest.mkdir(parents=True, exist_ok=True)
    shutil.move(str(out), dest / f"{verb}.json")
    return (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system)


def compare(a: Path, b: Path) -> list[str]:
    da, db = (without_timings(json.loads(p.read_text())) for p in (a, b))
    if da == db:
        return []
    return [f"{a.name} differs in {sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))}"]


def prepared(name: str, scen: Path, before: Path) -> Path:
    """The scenario, trained and attributed once with the BEFORE code (kept across --reuse-before runs)."""
    b_src = before / "src"
    p = checked(run([sys.executable, "-c", PREPARE, str(before / "tests"), name, str(scen)], src=b_src),
                f"prepare {name}")
    cfg = Path(p.stdout.strip().splitlines()[-1])
    if not (cfg.parent / "adapter" / "adapter_model.safetensors").exists():
        gradian(cfg, "train", [], b_src)
    if not (cfg.parent / "report.json").exists():
        gradian(cfg, "attribute", [], b_src)
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(ap, "gradian-equivalence-validate")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    args = ap.parse_args()
    rev, before, work = sides(args, ap, "equivalence_validate")
    b_src, a_src = before / "src", ROOT / "src"
    scen = work / f"scenarios-{rev[:12]}"
    bad = 0
    t_all = time.time()
    names = ["tiny-hf"] if args.smoke else [r for r in args.runs.split(",") if r]
    verbs = ((("verify", SMOKE_VERIFY_ARGS), ("fidelity", SMOKE_FIDELITY_ARGS)) if args.smoke else
             (("verify", VERIFY_ARGS), ("fidelity", FIDELITY_ARGS)))
    for name in names:
        if args.smoke:  # the tiny-hf scenario is bench/_smoke.py's tiny run: its training and report, not again
            from _smoke import seed_from_tiny

            seed_from_tiny(scen / name, outputs=True)
        cfg = prepared(name, scen, before)
        if not args.smoke:  # the retrain comparison is bench/equivalence.py's own, smoked there
            diffs = retrained_diffs(cfg, a_src)
            print(f"{name} train: {'identical' if not diffs else 'DIFFERENT: ' + '; '.join(diffs)}", flush=True)
            bad += bool(diffs)
        for verb, vargs in verbs:
            dest_b, dest_a = work / "results" / "before" / name, work / "results" / "after" / name
            cpu_b = None
            if not (args.reuse_before and (dest_b / f"{verb}.json").exists()):
                cpu_b = validate(cfg, verb, vargs, b_src, dest_b)
            cpu_a = validate(cfg, verb, vargs, a_src, dest_a)
            diffs = compare(dest_b / f"{verb}.json", dest_a / f"{verb}.json")
            bad += bool(diffs)
            cpu = f"CPU {cpu_b:.1f}s -> {cpu_a:.1f}s" if cpu_b is not None else f"CPU (after) {cpu_a:.1f}s"
            print(f"{name} {verb}: {'identical' if not diffs else 'DIFFERENT: ' + '; '.join(diffs)} ({cpu})",
                  flush=True)
    print(f"{bad} comparison(s) with differences, {time.time() - t_all:.0f} s wall")
    print(json.dumps({"bench": "equivalence_validate", "before": rev, "smoke": args.smoke, "runs": names,
                      "with_differences": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
