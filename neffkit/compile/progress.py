"""Build progress: a rich bar on a terminal, one plain line per finished graph otherwise."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._bar: Any = None
        self._task: Any = None
        self._stage = ""

    def start(self, stage: str, items: list[str]) -> None:
        self._stage = stage
        if not self.enabled or not items:
            return
        if self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(stage, total=len(items))
        else:
            print(f"{stage}: {len(items)} graph(s)", file=self.stream, flush=True)

    def done(self, name: str, seconds: float | None = None) -> None:
        if not self.enabled:
            return
        text = f"{seconds:.1f}s" if seconds is not None else "done"
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"{self._stage}: {name}")
            if self._bar.finished:
                self._bar.stop()
                self._bar = None
        else:
            print(f"  {self._stage} {name}: {text}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """Always shown (warnings, recompile reasons), also when the bar is off (--json)."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)
