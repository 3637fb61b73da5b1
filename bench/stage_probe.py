"""Peak RSS, CPU seconds and tokens per stage of one `gradian attribute` run, in this process (a bench helper).

`StageProbe().install()` wraps the functions each stage runs (by module attribute, so the product code carries no
instrumentation) in a probe that, on entry, credits the peak so far to the enclosing stage, returns freed heap to
the OS (`malloc_trim`) and resets the kernel's high-water mark (`/proc/self/clear_refs` 5), and on exit reads
`VmHWM`: the stage's own peak RSS, whatever ran before it. Stages nest (the data-aware fit runs inside the index
build); a stage's figures include its children. CPU time is `time.process_time`; tokens are the attention-mask
sums of the batches the stage collated (`setup.batches.collate`) and the tokens `generate` produced.

Run as a script, it probes one `attribute` of a config (in this process) and prints the table, then ONE JSON object
as the last line:

    .venv/bin/python bench/stage_probe.py RUN/gradian.yaml [--set output=probe-out]
    .venv/bin/python bench/stage_probe.py --smoke      # bench/_smoke.py's tiny scenario (make bench-smoke)

The smoke also checks that every function `STAGES` names still exists where it says (a renamed stage function
fails it, naming the stage).
"""

from __future__ import annotations

import ctypes
import time
from contextlib import contextmanager
from typing import Callable, Optional

# (stage, module, attribute): what each stage of attribute calls
STAGES = [
    ("load", "gradian.pipeline", "open_session"),
    ("evaluate", "gradian.pipeline", "measure_capability"),
    ("index", "gradian.pipeline", "open_index"),
    ("fit", "gradian.store.build", "ensure_basis"),
    ("query", "gradian.attribution.engine", "query_vectors"),
    ("precondition", "gradian.attribution.indexed", "fit_preconditioner"),
    ("score", "gradian.attribution.indexed", "score"),
    ("windows", "gradian.attribution.indexed", "index_windows"),
    ("rerank", "gradian.attribution.engine.ModelGradients", "exact_inner"),
    ("behaviour samples", "gradian.pipeline", "behaviour_queries"),
    ("decisive tokens", "gradian.pipeline", "decisive_starts"),
    ("one pass", "gradian.attribution.stage", "_one_pass"),
    ("checkpoints", "gradian.attribution.states.TracInAverage", "score"),
    ("base_scores", "gradian.pipeline", "rank_rows"),
    ("spans", "gradian.pipeline", "spans_stage"),
    ("clusters", "gradian.pipeline", "score_clusters"),
    ("blame", "gradian.pipeline", "blame"),
    ("report", "gradian.pipeline", "_write"),
]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # pragma: no cover
    _libc = None


def trim() -> None:
    if _libc is not None:
        _libc.malloc_trim(0)


class StageProbe:
    def __init__(self):
        self.stats: dict[str, dict] = {}
        self.stack: list[dict] = []
        self.process_peak_kb = 0
        self._undo: list[Callable[[], None]] = []
        self.cuda = False
        self.model_footprint: Optional[int] = None

    # -------------------------------------------------------------------------------------------- measuring

    def _peak_now(self) -> int:
        return _status_kb("VmHWM")

    @contextmanager
    def stage(self, name: str):
        peak = self._peak_now()
        self.process_peak_kb = max(self.process_peak_kb, peak)
        if self.stack:
            self.stack[-1]["peak"] = max(self.stack[-1]["peak"], peak)
        trim()
        _reset_hwm()
        frame = {"name": name, "start_rss": _status_kb("VmRSS"), "peak": 0, "tokens": 0,
                 "cpu0": time.process_time(), "wall0": time.perf_counter(), "gpu0": self._gpu_reset()}
        self.stack.append(frame)
        try:
            yield frame
        finally:
            self.stack.pop()
            frame["peak"] = max(frame["peak"], self._peak_now())
            self.process_peak_kb = max(self.process_peak_kb, frame["peak"])
            st = self.stats.setdefault(name, {"calls": 0, "cpu_s": 0.0, "wall_s": 0.0, "peak_mb": 0.0,
                                              "growth_mb": 0.0, "tokens": 0, "gpu_peak_mb": 0.0})
            st["calls"] += 1
            st["cpu_s"] += time.process_time() - frame["cpu0"]
            st["wall_s"] += time.perf_counter() - frame["wall0"]
            st["peak_mb"] = max(st["peak_mb"], frame["peak"] / 1024)
            st["growth_mb"] = max(st["growth_mb"], (frame["peak"] - frame["start_rss"]) / 1024)
            st["tokens"] += frame["tokens"]
            if self.cuda:
                st["gpu_peak_mb"] = max(st["gpu_peak_mb"], self._gpu_peak())
            if self.stack:
                self.stack[-1]["peak"] = max(self.stack[-1]["peak"], frame["peak"])
                self.stack[-1]["tokens"] += frame["tokens"]

    def _gpu_reset(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return 0

    def _gpu_peak(self) -> float:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20

    def count_tokens(self, n: int) -> None:
        if self.stack:
            self.stack[-1]["tokens"] += int(n)

    # -------------------------------------------------------------------------------------------- installing

    def _wrap(self, name: str, fn: Callable) -> Callable:
        probe = self

        def wrapped(*a, **kw):
            with probe.stage(name):
                out = fn(*a, **kw)
            if name == "load" and getattr(out, "model", None) is not None:
                probe.model_footprint = out.model.get_memory_footprint()
            return out

        wrapped.__wrapped__ = fn
        return wrapped

    def install(self, stages: Optional[list] = None) -> "StageProbe":
        import importlib

        for name, mod, attr in stages or STAGES:
            parts = mod.split(".")
            try:
                owner = importlib.import_module(mod)
            except ModuleNotFoundError:  # a class inside a module
                owner = getattr(importlib.import_module(".".join(parts[:-1])), parts[-1])
            orig = getattr(owner, attr)
            setattr(owner, attr, self._wrap(name, orig))
            self._undo.append(lambda o=owner, a=attr, f=orig: setattr(o, a, f))
        self._count_collate()
        self._count_generate()
        return self

    def _count_collate(self) -> None:
        import gradian.setup.batches as b

        orig = b.collate
        probe = self

        def collate(batch, pad_id, *, left=False):
            out = orig(batch, pad_id, left=left)
            probe.count_tokens(int(out[1].sum()))
            return out

        b.collate = collate
        self._undo.append(lambda: setattr(b, "collate", orig))

    def _count_generate(self) -> None:
        from peft import PeftModelForCausalLM

        orig = PeftModelForCausalLM.generate
        probe = self

        def generate(self_, *a, **kw):
            out = orig(self_, *a, **kw)
            ids = kw.get("input_ids")
            if ids is not None:
                probe.count_tokens(int(ids.numel()) + int(out.shape[0] * (out.shape[1] - ids.shape[1])))
            return out

        PeftModelForCausalLM.generate = generate
        self._undo.append(lambda: setattr(PeftModelForCausalLM, "generate", orig))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def table(self) -> list[dict]:
        out = []
        for name, _, _ in STAGES:
            st = self.stats.get(name)
            if st is None:
                continue
            row = {"stage": name, **{k: round(v, 3) if isinstance(v, float) else v for k, v in st.items()}}
            row["tokens_per_cpu_s"] = round(st["tokens"] / st["cpu_s"], 1) if st["tokens"] and st["cpu_s"] else None
            out.append(row)
        return out


def main(argv=None) -> int:
    import argparse
    import json
    import os
    import sys
    from pathlib import Path

    os.environ.setdefault("GRADIAN_THREADS", "1")
    os.environ.setdefault("GRADIAN_PROGRESS", "0")
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "src"))
    ap = argparse.ArgumentParser(description="Peak RSS, CPU seconds and tokens per stage of one `gradian attribute`")
    ap.add_argument("config", nargs="?", help="a run's gradian.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--smoke", action="store_true", help="on bench/_smoke.py's tiny scenario: checks the probe")
    a = ap.parse_args(argv)
    if a.smoke:
        from _smoke import tiny_run

        a.config, a.overrides = str(tiny_run() / "gradian.yaml"), a.overrides + ["output=probe-out"]
    if not a.config:
        ap.error("give a config (or --smoke)")
    import torch

    from gradian import api

    torch.set_num_threads(1)
    probe = StageProbe().install()
    try:
        rep = api.attribute(api.load_config(a.config, a.overrides))
    finally:
        probe.uninstall()
    rows = probe.table()
    for r in rows:
        print(f"{r['stage']:18s} calls {r['calls']:3d}  cpu {r['cpu_s']:8.2f} s  peak {r['peak_mb']:8.1f} MB  "
              f"growth {r['growth_mb']:8.1f} MB  tokens {r['tokens']}")
    print(json.dumps({"bench": "stage_probe", "config": a.config, "verdict": rep.verdict, "stages": rows,
                      "process_peak_mb": round(probe.process_peak_kb / 1024, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
