"""Progress bars with a rate and an ETA (rich), quiet when stderr is not a terminal unless asked.

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


def _enabled() -> bool:
    flag = os.environ.get("GRADIAN_PROGRESS")
    if flag is not None:
        return flag not in {"0", "false", "no"}
    return sys.stderr.isatty()


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
