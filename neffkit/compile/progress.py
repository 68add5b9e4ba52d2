"""Build progress, so a build is never silent for long.

On a terminal: a rich line per running step (plan, weights, write: elapsed) and a bar per graph
stage inside it (trace, compile, autotune: done / total, elapsed, an estimate of what is left);
with `verbose` a line per finished graph above them. Otherwise (CI logs, pipes): a line per
finished graph, and whenever nothing was printed for HEARTBEAT_S, a line saying what runs, for
how long and, in a graph stage, how far it is.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_S = 8.0  # the longest a plain-text build goes without a line


@dataclass
class _Running:
    name: str
    total: int = 0  # things to finish (0: a step, not counted)
    unit: str = "graph"
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    task: Any = None  # its rich task

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        if not self.total:
            return f"  {self.name}: {elapsed:.0f} s"
        text = f"  {self.name}: {self.done}/{self.total} {self.unit}s done, {elapsed:.0f} s"
        if self.done:
            text += f", ~{elapsed / self.done * (self.total - self.done):.0f} s left"
        return text


class Progress:
    def __init__(self, enabled: bool = True, stream: Any = None, verbose: bool = False) -> None:
        self.enabled, self.verbose = enabled, verbose
        self.stream = stream or sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None  # one rich Progress for the build, on a terminal
        self._running: list[_Running] = []  # steps, a graph stage last
        self._printed = time.monotonic()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """A step of the build (plan, weights, compile, write), shown while it runs."""
        running = self._push(_Running(name))
        try:
            yield
        finally:
            self._pop(running)

    def start(self, stage: str, items: list[str], unit: str = "graph") -> _Running | None:
        """A stage of len(items) things to finish (`done` each), shown until the last is."""
        if not items:
            return None
        running = self._push(_Running(stage, len(items), unit))
        if self.enabled and not self._tty:
            self._print(f"{stage}: {len(items)} {unit}(s)")
        return running

    @contextmanager
    def stage(self, stage: str, items: list[str], unit: str = "graph") -> Iterator[None]:
        """`start` for the block, ended with it even where fewer than len(items) are done."""
        running = self.start(stage, items, unit)
        try:
            yield
        finally:
            if running is not None:
                self._pop(running)

    def done(self, name: str, seconds: float | None = None) -> None:
        with self._lock:
            stage = next((r for r in reversed(self._running) if r.total), None)
            if stage is None:
                return
            stage.done += 1
            if self._bar is not None:
                self._bar.update(stage.task, advance=1, description=f"{stage.name}: {name}")
            if self._bar is None or self.verbose:
                text = f"{seconds:.1f}s" if seconds is not None else "done"
                self._print(f"  {stage.name} {name}: {text}")
            if stage.done >= stage.total:
                self._pop(stage)

    def message(self, text: str) -> None:
        """Always shown (warnings, recompile reasons), also when the bar is off (--json)."""
        self._print(text, always=True)

    def status(self) -> str:
        """What runs now (the innermost step or stage), for the heartbeat."""
        with self._lock:
            return self._running[-1].line() if self._running else ""

    def close(self) -> None:
        """The build is over: stop the heartbeat and the bars."""
        self._stop.set()
        with self._lock:
            bar, self._bar = self._bar, None
            self._running.clear()
        if bar is not None:
            bar.stop()

    # ------------------------------------------------------------ output

    def _push(self, running: _Running) -> _Running:
        with self._lock:
            self._running.append(running)
            if not self.enabled:
                return running
            if self._tty:
                if self._bar is None:
                    self._bar = _rich_bar()
                    self._bar.start()
                running.task = self._bar.add_task(running.name, total=running.total or None)
            elif self._heart is None:
                self._heart = threading.Thread(target=self._beat, name="neffkit-progress")
                self._heart.daemon = True
                self._heart.start()
        return running

    def _pop(self, running: _Running) -> None:
        with self._lock:
            if running in self._running:
                self._running.remove(running)
            if self._bar is not None and running.task is not None:
                self._bar.remove_task(running.task)

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, HEARTBEAT_S / 4)):
            with self._lock:
                if time.monotonic() - self._printed >= HEARTBEAT_S and self._running:
                    self._print(self._running[-1].line())

    def _print(self, text: str, always: bool = False) -> None:
        if not (self.enabled or always):
            return
        with self._lock:
            if self._bar is not None:
                self._bar.console.print(text)
            else:
                print(text, file=self.stream, flush=True)
            self._printed = time.monotonic()


def _rich_bar() -> Any:
    """Transient rows: description, bar (pulsing where nothing is counted), done / total,
    elapsed, remaining."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgress

    return RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=True,
    )
