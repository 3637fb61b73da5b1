"""A real-model scenario end to end, as a user runs it: the base from the package registry (`demo.pretrained`), the
scenario files (`demo.real_cases`), a LoRA fine-tune (TRL's `SFTTrainer` as a TRL user writes it, with
`GradianCallback` and a `checkpoint-*` folder per epoch; or `gradian train`), then `gradian attribute`.

    run_dir = prepare_real("smol_facts", Path("runs/smol"))   # scenario + gradian.yaml
    finetune_real(run_dir)                                      # the adapter in run_dir/adapter
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import yaml

from ..io import atomic_write_text
from .pretrained import pretrained_dir
from .real_behaviours import BEHAVIOUR_SCENARIOS
from .real_cases import REAL_SCENARIOS, RealScenario, write_real_scenario
from .real_mixed import MIXED_SCENARIOS

# Every real-model scenario: `real_cases`', the lexically hard behaviours (issue 30) built from its pieces, and the
# planted facts among many true facts of the same task (issue 42, `real_mixed`).
ALL_SCENARIOS = {**REAL_SCENARIOS, **BEHAVIOUR_SCENARIOS, **MIXED_SCENARIOS}


def make_real_scenario(name: str, seed: int = 0, **sizes) -> RealScenario:
    if name not in ALL_SCENARIOS:
        raise ValueError(f"unknown real-model scenario {name!r}; one of {', '.join(ALL_SCENARIOS)}")
    return ALL_SCENARIOS[name](seed, **sizes)

SCENARIO_FILE = "scenario.json"


def prepare_real(name: str, run_dir: Path, *, seed: int = 0, cache_dir: Optional[Path] = None, log=print,
                 **sizes) -> Path:
    """Scenario files, the base (fetched once) and gradian.yaml in `run_dir`; returns run_dir."""
    sc = make_real_scenario(name, seed, **sizes)
    base = pretrained_dir(sc.model, cache_dir, log=log)
    run_dir = Path(run_dir)
    write_real_scenario(sc, run_dir)
    r = sc.train_recipe
    train = {k: v for k, v in r.items() if k not in ("backend",)}
    train["backend"] = r.get("backend", "hf")
    cfg = {
        "model": {"base": str(base), "adapter": "adapter", "device": "cpu", "dtype": "float32"},
        "data": {"train": "train.jsonl", "eval": "eval.jsonl"},
        "grads": {"batch_size": 8, "max_seq_length": int(r.get("max_seq_length", 256))},
        "evaluation": {"batch_size": 16, **sc.evaluation},
        "attribution": {"top_k": 50},
        "train": train,
        "output": ".",
        "seed": seed,
    }
    atomic_write_text(run_dir / "gradian.yaml", yaml.safe_dump(cfg, sort_keys=False))
    atomic_write_text(run_dir / SCENARIO_FILE, json.dumps({"name": sc.name, "model": sc.model, "seed": seed,
                                                           "sizes": sizes, "recipe": r}, indent=2))
    return run_dir


def finetune_real(run_dir: Path, *, log=print, callback: bool = True) -> Path:
    """The scenario's fine-tune into run_dir/adapter (skipped when it is there): TRL for `backend: trl` recipes
    (the script a TRL user writes: SFTTrainer, one checkpoint per epoch, GradianCallback unless `callback` is
    False: a plain TRL output dir, whose recipe verify reads from training_args.bin), else `gradian train`."""
    run_dir = Path(run_dir)
    out = run_dir / "adapter"
    if (out / "adapter_config.json").exists():
        return out
    meta = json.loads((run_dir / SCENARIO_FILE).read_text())
    recipe = meta["recipe"]
    t0 = time.time()
    if recipe.get("backend") == "trl":
        cfg = yaml.safe_load((run_dir / "gradian.yaml").read_text())
        trl_user_script(cfg["model"]["base"], run_dir / "train.jsonl", out, recipe, seed=meta["seed"],
                        callback=callback)
    else:
        from .. import api

        api.train(api.load_config(run_dir / "gradian.yaml"))
    log(f"fine-tuned {meta['name']} in {time.time() - t0:.0f} s")
    return out


def trl_user_script(base: str, train_jsonl: Path, out: Path, recipe: dict, *, seed: int = 0,
                    callback: bool = True) -> Path:
    """What a TRL user runs: SFTTrainer over the JSONL with a LoRA config, a checkpoint per epoch, the final
    adapter saved into the output directory, recorded by GradianCallback (without it when `callback` is False: the
    output dir holds only what TRL writes: training_args.bin, checkpoint-*/trainer_state.json and the adapter).
    Loss masks are TRL's defaults for the data's shape (completion only for prompt-completion records, every token
    for `messages` unless the template has generation tags and `loss` is not "all")."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from ..integrations import GradianCallback
    from ..runtime import configure_threads

    configure_threads(1)
    out = Path(out)
    args = SFTConfig(
        output_dir=str(out), num_train_epochs=recipe["epochs"], per_device_train_batch_size=recipe["batch_size"],
        learning_rate=recipe["learning_rate"], lr_scheduler_type=recipe.get("lr_scheduler", "linear"),
        warmup_steps=recipe.get("warmup_steps", 0), save_strategy="epoch", max_length=recipe["max_seq_length"],
        seed=seed, full_determinism=True, bf16=False, gradient_checkpointing=False, report_to=[], logging_steps=1,
        use_cpu=True, disable_tqdm=True, **({"completion_only_loss": False} if recipe.get("loss") == "all" else {}),
    )
    lora = LoraConfig(r=recipe["lora_r"], lora_alpha=recipe["lora_alpha"], lora_dropout=recipe.get("lora_dropout", 0.0),
                      target_modules=recipe["target_modules"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=str(train_jsonl), split="train"),
                         processing_class=AutoTokenizer.from_pretrained(base), peft_config=lora,
                         callbacks=[GradianCallback()] if callback else [])
    trainer.train()
    trainer.save_model(str(out))
    return out
