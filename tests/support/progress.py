"""What the suite is building, said while it builds: `make test`'s first minutes on a cold
cache are builds inside pytest workers, whose output pytest keeps until a test ends.

Workers append a line to $NEFFKIT_TEST_PROGRESS when they start and finish making something for
the test cache (a checkpoint or a bundle: cache.cached_dir); the controller (tests/conftest.py)
prints each line as it comes, and whenever nothing was printed for HEARTBEAT_S, what is being
made and for how long, or how many tests have passed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

ENV = "NEFFKIT_TEST_PROGRESS"
HEARTBEAT_S = 8.0


def note(text: str) -> None:
    """One line for the controller to print (nothing where no controller reads them)."""
    path = os.environ.get(ENV)
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(path, "a") as f:  # one short append: whole lines from concurrent workers
        f.write(f"{time.monotonic():.3f}\t{worker}\t{text}\n")


class Reporter:
    """The controller's side: a thread that prints the workers' lines and a heartbeat."""

    def __init__(self, path: Path, write_line: Callable[[str], None]) -> None:
        self.path, self.write_line = path, write_line
        self.making: dict[str, float] = {}  # what is being made → since when
        self.passed = 0
        self.last = time.monotonic()  # the last line or test report
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, name="neffkit-test-progress")
        self._thread.daemon = True

    def start(self) -> None:
        self.path.write_text("")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def reported(self, passed: bool) -> None:
        """A test's report came in (pytest printed something)."""
        self.passed += passed
        self.last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, HEARTBEAT_S / 4)):
            for line in self._new_lines():
                _, worker, text = line.split("\t", 2)
                kind, _, what = text.partition(" ")
                if kind == "making":
                    self.making[what.split(" ")[0]] = time.monotonic()
                elif kind == "made":
                    self.making.pop(what.split(" ")[0].rstrip(":"), None)
                self._say(f"neffkit tests [{worker}]: {text}")
            if time.monotonic() - self.last >= HEARTBEAT_S:
                self._say(self.heartbeat())

    def heartbeat(self) -> str:
        now = time.monotonic()
        if self.making:
            items = ", ".join(f"{k} ({now - t:.0f} s)" for k, t in sorted(self.making.items()))
            return f"neffkit tests: making {items}; {self.passed} passed so far"
        return f"neffkit tests: {self.passed} passed so far, tests running"

    def _new_lines(self) -> list[str]:
        try:
            with self.path.open() as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        whole = data[: data.rfind("\n") + 1]
        self._offset += len(whole)
        return [line for line in whole.splitlines() if line.count("\t") >= 2]

    def _say(self, text: str) -> None:
        self.write_line(text)
        self.last = time.monotonic()
