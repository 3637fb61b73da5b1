"""Progress with a rate and an ETA: a bar (rich) on a terminal; plain lines when stderr is a log or a pipe (a line
when a step starts, one every `GRADIAN_PROGRESS_EVERY` seconds, default 30, with rows done, rate and ETA, and one
when it ends), so a run nobody watches still says what it is doing. `GRADIAN_PROGRESS=0` silences both,
`GRADIAN_PROGRESS=1` forces the bar.

Under torchrun only rank 0 draws, and its bar counts every rank's rows: each `advance` adds to a counter in
torch.distributed's store (`distributed.RowCounter`), and rank 0 shows the total."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


class _Bar:
    def __init__(self, progress: Optional[Progress], task):
        self._p, self._t = progress, task

    def advance(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._t, n)


def _mode() -> str:
    """"bar" on a terminal (or GRADIAN_PROGRESS=1), "lines" otherwise, "off" with GRADIAN_PROGRESS=0."""
    flag = os.environ.get("GRADIAN_PROGRESS")
    if flag is not None and flag.lower() in {"0", "false", "no", "off"}:
        return "off"
    if flag is not None and flag.lower() in {"1", "true", "yes", "bar"}:
        return "bar"
    if flag is not None and flag.lower() == "lines":
        return "lines"
    return "bar" if sys.stderr.isatty() else "lines"


def _enabled() -> bool:
    return _mode() != "off"


def _every() -> float:
    try:
        return max(1.0, float(os.environ.get("GRADIAN_PROGRESS_EVERY", "30")))
    except ValueError:
        return 30.0


def _clock(sec: float) -> str:
    sec = int(round(max(sec, 0.0)))
    h, rem = divmod(sec, 3600)
    m, s_ = divmod(rem, 60)
    return f"{h}h{m:02d}m{s_:02d}s" if h else (f"{m}m{s_:02d}s" if m else f"{s_}s")


def say(line: str) -> None:
    """One plain progress line on stderr (rank 0 only; not when progress is off)."""
    from .distributed import group

    if group().is_main and _enabled():
        print(f"[gradian] {line}", file=sys.stderr, flush=True)


class _Lines(_Bar):
    """Plain lines: start, every `_every()` seconds, end."""

    def __init__(self, desc: str, total: int, unit: str, counter=None):
        import time

        super().__init__(None, None)
        self.desc, self.total, self.unit, self.counter = desc, total, unit, counter
        self.done, self.t0 = 0, time.monotonic()
        self.last = self.t0
        say(f"{desc}: 0/{total} {unit}")

    def advance(self, n: int = 1) -> None:
        import time

        self.done = self.counter.add(n) if self.counter is not None else self.done + n
        now = time.monotonic()
        if now - self.last >= _every() and self.done < self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            say(f"{self.desc}: {self.done}/{self.total} {self.unit}, {rate:.2f} {self.unit}/s, "
                f"eta {_clock(eta) if eta != float('inf') else '?'}")

    def close(self) -> None:
        import time

        el = time.monotonic() - self.t0
        say(f"{self.desc}: {self.done}/{self.total} {self.unit} in {_clock(el)}"
            + (f" ({self.done / el:.2f} {self.unit}/s)" if el > 0 and self.done else ""))


_bars = [0]  # group bars opened: under torchrun every rank opens the same ones in the same order (the store key)


@contextmanager
def progress_bar(desc: str, total: int, unit: str = "rows", split: bool = False) -> Iterator[_Bar]:
    """`split`: under torchrun the ranks share the `total` (each does its own part), and rank 0's bar counts them
    all; otherwise every rank does the whole work and rank 0 shows its own."""
    from .distributed import RowCounter, current, group

    ranks = current()
    if ranks.active:
        _bars[0] += 1
    # split under torchrun: the ranks share `total`, each adds its rows to a counter in the c10d store and rank 0
    # shows the sum; otherwise (every rank doing the whole work, or one working `alone`) rank 0 shows its own
    counter = RowCounter(f"bar-{_bars[0]}") if ranks.active and split else None
    if group().is_main and _mode() == "lines" and total > 0:
        bar = _Lines(desc, total, unit, counter)
        try:
            yield bar
        finally:
            bar.close()
        return
    if not group().is_main or not _enabled() or total <= 0:
        if counter is None:
            yield _Bar(None, None)
            return

        class _Counting(_Bar):
            def advance(self, n: int = 1) -> None:
                counter.add(n)

        yield _Counting(None, None)
        return
    columns = [
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("[cyan]{task.fields[rate]}"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as p:
        task = p.add_task(desc, total=total, rate="")

        class _RateBar(_Bar):
            def advance(self, n: int = 1) -> None:
                if counter is not None:  # every rank's rows
                    p.update(task, completed=counter.add(n))
                else:
                    p.advance(task, n)
                speed = p.tasks[0].speed
                if speed:
                    p.update(task, rate=f"{speed:.1f} {unit}/s")

        yield _RateBar(p, task)
