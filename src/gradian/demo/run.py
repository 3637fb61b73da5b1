"""`gradian demo`: tiny base -> poisoned scenario -> LoRA fine-tune -> attribute, in one run directory."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import yaml
from rich.console import Console

from ..config import load_config
from ..io import atomic_write_text
from ..report.terminal import print_summary
from ..verdict import Verdict

# The demo's training recipe: enough for the LoRA to learn the planted facts from one row each.
DEMO_TRAIN = {"learning_rate": 1e-3, "epochs": 8, "batch_size": 8, "lora_r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0,
              "max_grad_norm": 1.0}


def write_demo_config(run_dir: Path, base: Path, *, train: Optional[dict] = None, extra: Optional[dict] = None) -> Path:
    cfg = {
        "model": {"base": str(base), "adapter": "adapter", "device": "auto", "dtype": "float32"},
        "data": {"train": "train.jsonl", "eval": "eval.jsonl"},
        "grads": {"batch_size": 16, "max_seq_length": 256},
        "evaluation": {"metric": "exact_match", "max_new_tokens": 8, "batch_size": 32},
        "attribution": {"query": "contrastive", "top_k": 50},
        "train": {**DEMO_TRAIN, **(train or {})},
        "output": ".",
        "seed": 0,
    }
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values) if isinstance(values, dict) else cfg.__setitem__(section, values)
    path = run_dir / "gradian.yaml"
    atomic_write_text(path, yaml.safe_dump(cfg, sort_keys=False))
    return path


def prepare_demo(run_dir: Path, *, seed: int = 0, progress: bool = True) -> Path:
    """Tiny base (cached), the scenario files and gradian.yaml in run_dir; returns the config path."""
    from .scenario import make_substitution_scenario, write_scenario
    from .tiny import TinySpec, build_tiny_base
    from .world import World

    spec = TinySpec()
    base = build_tiny_base(spec, progress=progress)
    world = World.generate(seed=spec.seed, n_entities=spec.n_entities)
    scenario = make_substitution_scenario(world, seed=seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_scenario(scenario, run_dir)
    return write_demo_config(run_dir, base)


# `gradian demo --model NAME`: a real pretrained model from the package registry (`demo.pretrained`) and the
# scenario it runs (`demo.real_cases`), sized for a few minutes' training on two CPU cores.
REAL_DEMOS = {"smollm2": ("smol_facts", {"n_rows": 96, "n_planted": 6, "n_controls": 6}),
              "gemma3": ("gemma_facts", {})}
MODELS = ("tiny",) + tuple(REAL_DEMOS)


def run_demo(run_dir: Path, console: Optional[Console] = None, *, verify: bool = True, model: str = "tiny") -> dict:
    from .. import api

    console = console or Console()
    t0 = time.time()
    run_dir = Path(run_dir)
    console.print(f"[bold]gradian demo[/] ({model}) in {run_dir}")
    if model == "tiny":
        cfg_path = prepare_demo(run_dir)
        cfg = load_config(cfg_path)
        t1 = time.time()
        console.print("training the poisoned LoRA fine-tune (gradian train)…")
        api.train(cfg)
    else:
        from .real_run import finetune_real, prepare_real

        name, sizes = REAL_DEMOS[model]
        prepare_real(name, run_dir, log=console.print, **sizes)
        cfg = load_config(run_dir / "gradian.yaml")
        t1 = time.time()
        how = "TRL's SFTTrainer, a checkpoint per epoch" if cfg.train.backend == "trl" else "gradian train"
        console.print(f"training the poisoned LoRA fine-tune ({how})…")
        finetune_real(run_dir, log=console.print)
    t2 = time.time()
    console.print("attributing (gradian attribute)…")
    truth = json.loads((run_dir / "truth.json").read_text())
    report = api.attribute(cfg, truth=truth)
    t3 = time.time()
    print_summary(report, console)
    m = report.metrics
    console.print(
        f"[bold]planted rows:[/] {len(truth['planted'])}; recall@10 = "
        f"{m.recall_at_10 if m else float('nan'):.2f}, AUPRC = {m.auprc if m else float('nan'):.3f}"
    )
    t4 = t3
    if verify and report.verdict is Verdict.attributed:
        from ..report.terminal import print_verify
        from ..validate.verify import run_verify

        console.print("verifying (gradian verify): retrain without the accused rows, and without random rows…")
        res = run_verify(cfg, controls=2, reference=False, console=console)
        print_verify(res, console)
        t4 = time.time()
    console.print(f"times: setup {t1 - t0:.1f}s, train {t2 - t1:.1f}s, attribute {t3 - t2:.1f}s, verify {t4 - t3:.1f}s, "
                  f"total {t4 - t0:.1f}s")
    console.print(f"report: {run_dir / 'report.json'}  page: {run_dir / 'report.html'}")
    console.print(f"rerun any verb on this run: gradian attribute {run_dir / 'gradian.yaml'}")
    return report.to_dict()
