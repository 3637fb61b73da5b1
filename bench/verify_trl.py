"""`gradian verify` on a plain TRL output dir: a real SmolLM2 fine-tune trained WITHOUT GradianCallback.

    .venv/bin/python bench/verify_trl.py --work /tmp/verify-trl --rows 120 --controls 2
    .venv/bin/python bench/verify_trl.py --work /tmp/verify-trl300 --rows 300 --controls 2
    .venv/bin/python bench/verify_trl.py --smoke     # the tiny scenario of bench/_smoke.py, a plain TRL run (seconds)

Stages (each skipped when its output is already there, so a run can be resumed):

1. the scenario (`smol_facts` by default, `--rows` training rows) and a `gradian.yaml` with no `train` section: what
   `gradian attribute --adapter ... --train ... --eval ...` writes for a user, so nothing of the recipe comes from
   Gradian's config;
2. the fine-tune: `demo.real_run.trl_user_script(..., callback=False)`, TRL's SFTTrainer with a linear schedule and
   one checkpoint per epoch, saved with `trainer.save_model`: the dir holds `training_args.bin`, `adapter_config.json`
   and `checkpoint-*/trainer_state.json`, and no `gradian_recipe.json`;
3. `gradian attribute gradian.yaml` (a subprocess: its exit code is the user's);
4. `gradian verify gradian.yaml --controls N` (a subprocess): the recipe read from the TRL dir without executing its
   pickle, the reference retrain's distance to the adapter, the accused and random-control retrains.

Prints the exit codes, the reference retrain's distance to the user's adapter, the reverted fraction of the accused
retrain and its interval, each control's, the verdict, CPU seconds per stage (one torch thread), and ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _gradian(*args: str, log) -> tuple[int, float]:
    """Run `python -m gradian ARGS` as a user would; (exit code, CPU seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    c0 = _children_cpu()
    log(f"$ gradian {' '.join(args)}")
    p = subprocess.run([sys.executable, "-m", "gradian", *args], env=env, text=True, capture_output=True)
    sys.stdout.write(p.stdout[-6000:])
    sys.stderr.write(p.stderr[-3000:])
    return p.returncode, _children_cpu() - c0


def prepare(run: Path, scenario: str, rows: int, log) -> None:
    import yaml

    from gradian.demo.real_run import prepare_real

    if (run / "gradian.yaml").exists():
        return
    prepare_real(scenario, run, n_rows=rows, log=log)
    cfg = yaml.safe_load((run / "gradian.yaml").read_text())
    cfg.pop("train", None)  # a user's config: the recipe is whatever the TRL dir says
    (run / "gradian.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def prepare_smoke(run: Path) -> None:
    """The tiny scenario of bench/_smoke.py as a user's config (no train section) over a plain TRL dir."""
    import yaml

    from _smoke import write_tiny_scenario

    if (run / "gradian.yaml").exists():
        return
    cfg_path = write_tiny_scenario(run)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg.pop("train", None)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def finetune_smoke(run: Path) -> float:
    """TRL's SFTTrainer on the tiny scenario, no callback (the plain user's script, tiny settings)."""
    import yaml
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    if (run / "adapter" / "adapter_config.json").exists():
        return 0.0
    t0 = time.process_time()
    base = yaml.safe_load((run / "gradian.yaml").read_text())["model"]["base"]
    args = SFTConfig(output_dir=str(run / "adapter"), num_train_epochs=3, per_device_train_batch_size=8,
                     learning_rate=1e-2, warmup_steps=2, assistant_only_loss=True, max_length=64, seed=3,
                     save_strategy="epoch", report_to=[], disable_tqdm=True, use_cpu=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                      task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(base), args=args,
                         train_dataset=load_dataset("json", data_files=str(run / "train.jsonl"), split="train"),
                         processing_class=AutoTokenizer.from_pretrained(base), peft_config=lora)
    trainer.train()
    trainer.save_model(str(run / "adapter"))
    return time.process_time() - t0


def finetune(run: Path, log) -> float:
    """The plain TRL fine-tune in this process (one thread); its CPU seconds (0 when it was there)."""
    from gradian.demo.real_run import finetune_real

    if (run / "adapter" / "adapter_config.json").exists():
        return 0.0
    t0 = time.process_time()
    finetune_real(run, log=log, callback=False)
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="the run directory (created; reused when it is there)")
    ap.add_argument("--scenario", default="smol_facts")
    ap.add_argument("--rows", type=int, default=120, help="training rows of the scenario")
    ap.add_argument("--controls", type=int, default=2, help="random-row control retrains")
    ap.add_argument("--until", choices=("finetune", "attribute", "verify"), default="verify")
    ap.add_argument("--smoke", action="store_true", help="the tiny scenario of bench/_smoke.py: checks the script")
    args = ap.parse_args()
    if not args.smoke and not args.work:
        ap.error("give --work (or --smoke)")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.smoke:
        from _smoke import work_dir

        run = work_dir("verify_trl")
        args.scenario, args.rows, args.controls = "tiny", 48, 1
        prepare_smoke(run)
        ft_cpu = finetune_smoke(run)
    else:
        run = Path(args.work).resolve()
        prepare(run, args.scenario, args.rows, log)
        ft_cpu = finetune(run, log)
    adapter = run / "adapter"
    assert not (adapter / "gradian_recipe.json").exists(), "the fine-tune must be a plain TRL run (no callback)"
    log(f"plain TRL output dir: {sorted(p.name for p in adapter.iterdir())}")
    out = {"bench": "verify_trl", "scenario": args.scenario, "rows": args.rows, "finetune_cpu_s": round(ft_cpu, 1)}
    if args.until == "finetune":
        print(json.dumps(out))
        return
    if not (run / "report.json").exists():
        rc, cpu = _gradian("attribute", str(run / "gradian.yaml"), log=log)
        out.update({"attribute_exit": rc, "attribute_cpu_s": round(cpu, 1)})
        if rc != 0:
            print(json.dumps(out))
            sys.exit(1)  # the run could not go on: a failure, not a figure
    rep = json.loads((run / "report.json").read_text())
    truth = json.loads((run / "truth.json").read_text())
    acc = (rep.get("accused") or {}).get("positions", [])
    out.update({"verdict": rep["verdict"], "accused": len(acc),
                "accused_planted": len(set(acc) & set(truth["planted"])), "planted": len(truth["planted"])})
    if args.until == "attribute":
        print(json.dumps(out))
        return
    (run / "verify.json").unlink(missing_ok=True)  # an earlier run's must not stand for this one's
    rc, cpu = _gradian("verify", str(run / "gradian.yaml"), "--controls", str(args.controls), log=log)
    out.update({"verify_exit": rc, "verify_cpu_s": round(cpu, 1)})
    if (run / "verify.json").exists():
        v = json.loads((run / "verify.json").read_text())
        ref = v.get("reproduction") or {}
        a = v["accused"]
        out.update({
            "verify_verdict": v.get("verdict"), "confirmed": v["confirmed"], "top_k": v["top_k"],
            "base": v["base"], "tuned": v["tuned"], "original_tuned": v["original_tuned"],
            "reference_bit_for_bit": (v.get("reference") or {}).get("reproduced_bit_for_bit"),
            "reference_weight_distance": ref.get("weight_distance"),
            "reference_capability_gap": ref.get("capability_gap"),
            "reproduced": ref.get("reproduced"),
            "accused_reverted": a["reverted_fraction"], "accused_ci": a["ci"],
            "controls_reverted": [c["reverted_fraction"] for c in v["controls"]],
            "statement": v["statement"],
        })
        print(f"verify exit {rc}: {v['statement']}")
        print(f"reference retrain: weight distance {ref.get('weight_distance')}, capability gap "
              f"{ref.get('capability_gap')}, reproduced {ref.get('reproduced')}")
        print(f"accused reverted {a['reverted_fraction']} interval {a['ci']}; controls "
              f"{[c['reverted_fraction'] for c in v['controls']]}")
    print(json.dumps(out))
    if rc != 0 or not (run / "verify.json").exists():
        sys.exit(1)  # verify failed: the JSON line above says how, the exit status says that it did


if __name__ == "__main__":
    main()
