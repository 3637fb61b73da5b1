"""What a run says about itself while it runs: one line per stage on stderr when nobody watches a terminal, each
stage's wall and CPU seconds, out-of-memory in a stage as an error that names it (`memory.memory_guard`), and the
report flags the stages raise. The session holds the loaded inputs; what the run records about itself is here.

    log = RunLog()
    with log.stage("index"):
        ...                       # "[gradian] index ..." then "[gradian] index done in 4m12s (CPU 4m05s)"
    log.flag("index.projection_fidelity", "warning", "...", "...")
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from .memory import memory_guard
from .progress import _clock, say


@dataclass
class RunLog:
    timings: dict = field(default_factory=dict)  # wall seconds per stage (report.json `timings`)
    cpu: dict = field(default_factory=dict)  # CPU seconds of this process per stage (report.json `timings_cpu`)
    flags: list[dict] = field(default_factory=list)  # report.json `flags`: {id, level, message, fix}, in raise order

    def flag(self, id: str, level: str, message: str, fix: str = "") -> None:
        """Raise a report flag; the first raise of an id wins (a stage run per checkpoint raises it once)."""
        if not any(f["id"] == id for f in self.flags):
            self.flags.append({"id": id, "level": level, "message": message, "fix": fix})

    @contextmanager
    def stage(self, name: str, *, guard: str | None = None, quiet: bool = False) -> Iterator[None]:
        """Time one stage (added to what the stage already took: a stage may run in parts), print a line when it
        starts and when it ends (progress lines), and turn running out of memory into a `ResourceError` naming
        `guard` (default: the stage)."""
        if not quiet:
            say(f"{name} ...")
        t0, c0 = time.time(), time.process_time()
        with memory_guard(guard or name):
            yield
        dt, dc = time.time() - t0, time.process_time() - c0
        self.timings[name] = round(self.timings.get(name, 0.0) + dt, 3)
        self.cpu[name] = round(self.cpu.get(name, 0.0) + dc, 3)
        if not quiet:
            say(f"{name} done in {_clock(dt)} (CPU {_clock(dc)})")
