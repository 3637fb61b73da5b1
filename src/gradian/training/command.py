"""`train.command`: any training script as the retraining backend, run as a subprocess once per retrain.

The command line is split like a shell would (`shlex`) but run without one; in each word the placeholders
`{train}` (a JSONL of the kept rows, in file order, each record as gradian read it), `{output}` (the adapter
directory the script must write: adapter_config.json + adapter_model.safetensors), `{seed}` (the config's seed) and
`{base}` (model.base) are filled in. Its standard output and error go to a log file the caller names (verify keeps
it beside verify.json). A script reshuffles its own data: removing rows cannot keep the others' batches there, which
is why verify's random controls are retrained by the same command and compared like for like.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

from ..errors import ConfigError, TrainingError

PLACEHOLDERS = ("train", "output", "seed", "base")
_FIELD = re.compile(r"\{([^{}]*)\}")
TAIL_LINES = 15


def command_words(command: str, values: dict[str, str]) -> list[str]:
    """The argv of `command` with its placeholders filled in; ConfigError naming an unknown one."""
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise ConfigError(f"train.command: cannot be split into words ({e}); check the quotes") from None
    if not words:
        raise ConfigError("train.command is empty")
    out = []
    for w in words:
        for name in _FIELD.findall(w):
            if name not in PLACEHOLDERS:
                raise ConfigError(f"train.command: unknown placeholder {{{name}}}; the placeholders are "
                                  + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
        out.append(_FIELD.sub(lambda m: values[m.group(1)], w))
    return out


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    body = [ln for ln in lines if not ln.startswith("### ")][-n:]
    return " | ".join(ln.strip() for ln in body if ln.strip())


def train_command(cfg, *, exclude: Iterable[int] = (), out_dir: Optional[Path] = None, log_path: Optional[Path] = None,
                  label: str = "train", progress: bool = True) -> Path:
    """Run train.command on data.train minus `exclude`; the adapter it wrote, moved to `out_dir`. Appends the run
    (command, exit status, output) to `log_path`. TrainingError when the script cannot start, fails, runs past
    train.command_timeout or writes no adapter."""
    from ..setup.model import base_ref
    from ..setup.records import data_location, load_train

    command = cfg.train.command
    if not command:
        raise ConfigError("train.command is not set")
    excluded = set(int(p) for p in exclude)
    examples = load_train(data_location(cfg, cfg.data.train))
    out_dir = Path(out_dir) if out_dir else cfg.adapter_out
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.command-", dir=out_dir.parent))
    log_path = Path(log_path) if log_path else out_dir.parent / f"{out_dir.name}.train.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = work / "train.jsonl"
        kept = [e for e in examples if e.position not in excluded]
        data.write_text("".join(json.dumps(e.record, ensure_ascii=False) + "\n" for e in kept), encoding="utf-8")
        target = work / "adapter"
        argv = command_words(command, {"train": str(data), "output": str(target), "seed": str(cfg.seed),
                                       "base": str(base_ref(cfg))})
        env = {**os.environ, "GRADIAN_TRAIN": str(data), "GRADIAN_OUTPUT": str(target), "GRADIAN_SEED": str(cfg.seed)}
        timeout = cfg.train.command_timeout
        t0 = time.time()
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"### {label}: {len(kept)} rows ({len(excluded)} removed); {shlex.join(argv)}\n")
            log.flush()
            try:
                proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      cwd=cfg.root or None, env=env, timeout=timeout)
            except FileNotFoundError:
                raise TrainingError(f"train.command: cannot run '{argv[0]}': no such program (in PATH or relative "
                                    f"to {cfg.root or os.getcwd()}); log {log_path}") from None
            except PermissionError:
                raise TrainingError(f"train.command: '{argv[0]}' is not executable; run it through its interpreter "
                                    f"(e.g. 'python {argv[0]} ...'); log {log_path}") from None
            except subprocess.TimeoutExpired:
                log.write(f"### {label}: stopped after train.command_timeout {timeout:g} s\n")
                raise TrainingError(f"train.command timed out after {timeout:g} s (train.command_timeout) on the "
                                    f"'{label}' retrain; raise train.command_timeout or shorten the run; log "
                                    f"{log_path}") from None
            log.write(f"### {label}: exit status {proc.returncode} after {time.time() - t0:.1f} s\n")
        if proc.returncode != 0:
            raise TrainingError(f"train.command failed with exit status {proc.returncode} on the '{label}' retrain; "
                                f"last output: {_tail(log_path) or '(none)'}; full log {log_path}")
        if not (target / "adapter_config.json").is_file() or not any(
                (target / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
            raise TrainingError(f"train.command exited 0 but wrote no PEFT adapter to {{output}} ({target}: expected "
                                "adapter_config.json and adapter_model.safetensors, e.g. model.save_pretrained("
                                f"output) or trainer.save_model(output)); log {log_path}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(target, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir
