"""Engine threads on a shared host: one fewer while another process takes a core.

With one thread per usable CPU and OpenMP's spinning wait, a single busy process on the host
costs the server most of its throughput: at every parallel region the threads wait for the one
that lost its core (bench/threads.py on 2 cores: 8-stream serving kept 36% of its quiet
throughput beside one busy process; with one thread fewer, 87%; with the governor, 63%, the
quiet figure unchanged). Spinning is worth about a third of the quiet throughput, so it stays;
instead the governor watches decode steps. When the median of the last
few is well above the fastest the same graph ran at full threads, it drops a thread; every few
seconds it tries full threads again for a few steps and keeps them if those steps are back near
the fastest. It acts only when nobody chose the thread count (`--threads`,
NEFFKIT_ENGINE_THREADS).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

WINDOW = 8  # decode steps whose median decides
SLOW = 1.8  # median step / fastest at full threads: contention
RECOVERED = 1.3  # a probe's median below this: full threads again
PROBE_EVERY_S = 5.0
PROBE_STEPS = 4


class ThreadGovernor:
    def __init__(
        self,
        full: int,
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.full = full
        self.current = full
        self.set_threads, self.clock = set_threads, clock
        self.fastest: dict[str, float] = {}  # graph → its fastest step at full threads
        self.recent: deque[float] = deque(maxlen=WINDOW)  # step / fastest, at full threads
        self.probing = 0  # steps left in a probe of full threads
        self.next_probe = math.inf
        self.reductions = 0  # times it dropped a thread (run --json, tests)

    def observe(self, graph: str, seconds: float) -> None:
        """One decode step of `graph` took `seconds` at the current thread count."""
        if self.full <= 1:
            return
        if self.current < self.full:
            if self.clock() >= self.next_probe:
                self._set(self.full)
                self.probing = PROBE_STEPS
            return
        fastest = self.fastest.setdefault(graph, seconds)
        if seconds < fastest:
            self.fastest[graph] = fastest = seconds
        self.recent.append(seconds / fastest)
        if self.probing:
            self.probing -= 1
            if not self.probing and statistics.median(list(self.recent)[-PROBE_STEPS:]) > RECOVERED:
                self._reduce()
            return
        if len(self.recent) == WINDOW and statistics.median(self.recent) >= SLOW:
            self._reduce()

    def _reduce(self) -> None:
        self._set(self.full - 1)
        self.reductions += 1
        self.next_probe = self.clock() + PROBE_EVERY_S

    def _set(self, threads: int) -> None:
        self.current = threads
        self.recent.clear()
        self.set_threads(threads)
