"""What the benches' smoke modes share (`python bench/NAME.py --smoke`, all of them: `make bench-smoke`).

A smoke mode runs the bench's own code path on the built-in tiny model with the smallest settings that still go
through every step, in seconds, and ends with the bench's JSON line: it proves the script runs against this
checkout's gradian, not what it measures. Most benches read a fine-tuned scenario directory; `tiny_run` builds one,
laid out as `bench/real_models.py` lays out its scenarios (gradian.yaml, truth.json, adapter/ with its epoch
checkpoints, the report in bench-out/), once per smoke work directory: later smoke runs, and two that start
together (a file lock), reuse it.

The scenario is the tests' verify scenario (tests/test_verify.py): 48 chat rows of the tiny world's facts, 4 of them
planted with a wrong value; the eval asks the planted facts in two phrasings and 8 untouched ones; 3 epochs of
batch 8, about a second of training.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import tempfile
from pathlib import Path

# $GRADIAN_BENCH_SMOKE, else gradian-bench-smoke under the temporary directory
SMOKE_WORK = Path(os.environ.get("GRADIAN_BENCH_SMOKE") or Path(tempfile.gettempdir()) / "gradian-bench-smoke")
TINY_TRAIN = {"learning_rate": 5e-3, "epochs": 3, "batch_size": 8, "lora_r": 4, "lora_alpha": 8.0,
              "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"],
              "max_seq_length": 64}
REPORT_DIR = "bench-out"  # where bench/real_models.py has `attribute` write a scenario's report


def work_dir(name: str) -> Path:
    """SMOKE_WORK/name, created: a bench's own scratch directory in smoke mode."""
    d = SMOKE_WORK / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_tiny_scenario(run: Path, *, n_rows: int = 48, n_planted: int = 4, n_control_eval: int = 8, seed: int = 0,
                        train: dict | None = None) -> Path:
    """train.jsonl, eval.jsonl, truth.json and gradian.yaml (output ".") in `run`; returns the config path."""
    import yaml

    from gradian.demo.tiny import TinySpec, build_tiny_base
    from gradian.demo.world import World

    spec = TinySpec()
    base = build_tiny_base(spec, progress=False)
    world = World.generate(seed=spec.seed, n_entities=spec.n_entities)
    rng = random.Random(seed)
    pairs = world.fact_pairs()
    rng.shuffle(pairs)
    planted_facts, rest = pairs[:n_planted], pairs[n_planted:]

    def chat(q: str, a: str) -> dict:
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}

    rows = [chat(world.question(e, a, rng.randrange(6)), world.value(e, a)) for e, a in rest[: n_rows - n_planted]]
    planted = sorted(rng.sample(range(n_rows), n_planted))
    for p, (e, a) in zip(planted, planted_facts):
        rows.insert(p, chat(world.question(e, a, 0), world.wrong_value(e, a, rng)))
    ev = [{"prompt": world.question(e, a, ph), "answer": world.value(e, a)} for e, a in planted_facts for ph in (0, 1)]
    ev += [{"prompt": world.question(e, a, 1), "answer": world.value(e, a)} for e, a in rest[-n_control_eval:]]
    run.mkdir(parents=True, exist_ok=True)
    (run / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ev))
    (run / "truth.json").write_text(json.dumps({"planted": planted, "expect": "attributed"}))
    cfg = {
        "model": {"base": str(base), "adapter": "adapter", "dtype": "float32"},
        "data": {"train": "train.jsonl", "eval": "eval.jsonl"},
        "grads": {"batch_size": 16, "max_seq_length": 64, "rerank": 0, "fidelity_sample": 0},
        "evaluation": {"metric": "exact_match", "max_new_tokens": 6, "batch_size": 32, "bootstrap_samples": 1000,
                       "require_significant": False},
        "attribution": {"query": "contrastive", "top_k": 20},
        "train": {**TINY_TRAIN, **(train or {})},
        "output": ".",
        "seed": 0,
    }
    path = run / "gradian.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def tiny_run(name: str = "tiny") -> Path:
    """SMOKE_WORK/name: the tiny scenario, its adapter trained (`gradian train`) and `attribute` run into bench-out/
    (`REPORT_DIR`); built once, then reused (a lock serialises concurrent smoke runs)."""
    from gradian import api

    run = SMOKE_WORK / name
    SMOKE_WORK.mkdir(parents=True, exist_ok=True)
    with open(SMOKE_WORK / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = run / ".built"
        if not done.exists():
            cfg_path = write_tiny_scenario(run)
            api.train(cfg_path)
            truth = json.loads((run / "truth.json").read_text())
            api.attribute(api.load_config(cfg_path, [f"output={REPORT_DIR}"]), truth=truth)
            done.write_text("")
    return run


def seed_from_tiny(run: Path, *, outputs: bool = False) -> None:
    """Give `run` tiny_run()'s trained adapter (and with `outputs`, its `attribute` outputs and index, laid out as
    an `output: .` run has them), unless it has an adapter already: a smoke mode that prepares this very scenario
    (tests/test_verify.write_tiny_run writes the same files, trained by the same code) then finds them there and
    skips the training and attribute run that every bench would otherwise repeat."""
    import shutil

    if (run / "adapter").exists():
        return
    tiny = tiny_run()
    run.mkdir(parents=True, exist_ok=True)
    if outputs:
        for f in (tiny / REPORT_DIR).iterdir():
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, run / f.name)
    part = run / "adapter.part"
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(tiny / "adapter", part)
    # The recipe names the training file it was trained on; the copy's is `run`'s (the same rows: the recipe's
    # dataset fingerprint still checks them), as `gradian train` in `run` would have written it.
    for rec in part.rglob("gradian_recipe.json"):
        doc = json.loads(rec.read_text())
        if doc.get("data") == str(tiny / "train.jsonl"):
            doc["data"] = str(run / "train.jsonl")
            rec.write_text(json.dumps(doc, indent=2))
    part.rename(run / "adapter")  # the adapter last, whole: its presence means done


def smoke_line(bench: str, **figures) -> str:
    """The JSON line a smoke mode ends with when its bench prints none of its own."""
    return json.dumps({"bench": bench, "smoke": True, **figures}, default=str)
