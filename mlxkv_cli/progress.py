"""Progress on stderr: a rich bar (what runs now, elapsed, ETA) on a terminal, one line a step in a
pipe or a log (a live bar there would print nothing until the end)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
                           TransferSpeedColumn)


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Steps:
    """`total` steps of a long job; `start(label)` before each, `done()` at the end."""

    def __init__(self, console: Console, total: int, title: str):
        self.console, self.total, self.title = console, total, title
        self.n, self.t0 = 0, time.perf_counter()
        self.live = console.is_terminal
        self.bar = None
        if self.live:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                                transient=True)
            self.task = self.bar.add_task(title, total=total)
            self.bar.start()

    def start(self, label: str) -> None:
        """Step `label` begins (the previous one, if any, is done)."""
        if self.live:
            self.bar.update(self.task, description=f"{self.title}: {label}", completed=self.n)
        else:
            elapsed = time.perf_counter() - self.t0
            eta = f", ~{_clock(elapsed / self.n * (self.total - self.n))} left" if self.n else ""
            self.console.print(f"{self.title} {self.n + 1}/{self.total}: {label} ({_clock(elapsed)} elapsed{eta})",
                               highlight=False, soft_wrap=True)
        self.n += 1

    def done(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


@contextmanager
def steps(console: Console, total: int, title: str):
    s = Steps(console, total, title)
    try:
        yield s
    finally:
        s.done()


@contextmanager
def byte_bar(console: Console, title: str):
    """A bytes bar on a terminal, a start and an end line elsewhere; yields `update(done, total, name)`."""
    if not console.is_terminal:
        console.print(f"{title} ...", highlight=False, soft_wrap=True)
        seen = {}

        def line(done: int, total: int, name: str):
            seen.update(done=done, total=total)

        yield line
        console.print(f"{title}: {seen.get('done', 0) / 1e6:.1f} MB", highlight=False, soft_wrap=True)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(title, total=None)

        def update(done: int, total: int, name: str):
            bar.update(task, completed=done, total=total or None, description=f"{title}: {name}")

        yield update


@contextmanager
def counted(console: Console):
    """A `(done, total, what)` callback (fidelity, calibrate): a bar on a terminal, else one line a step."""
    if not console.is_terminal:
        yield lambda done, total, what: console.print(f"[{done}/{total}] {what}")
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("loading", total=None)
        yield lambda done, total, what: bar.update(task, completed=done, total=total, description=what)
