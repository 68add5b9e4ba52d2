"""Engine threads on a shared host: one fewer while another process takes a core.

With one thread per usable CPU and OpenMP's spinning wait, a single busy process on the host
costs the engine most of its speed: at every parallel region the threads wait for the one that
lost its core (bench/threads.py on 2 cores: 8-stream serving kept 36% of its quiet throughput
beside one busy process; with one thread fewer, 87%). Spinning is worth about a third of the
quiet throughput, so it stays; instead the governor times decode steps at both counts and keeps
the faster, per graph (a bigger bucket is slower, not contended). It compares means, not
medians: beside a busy process most steps at full threads run near one thread's speed and every
few steps one stalls for a scheduler slice (~40 ms steps, then ~190 ms: SmolLM2 on 2 cores), so
the median hides what the stalls cost.

- after the first few steps at full threads it tries one fewer for a few steps, so contention
  that is there from the start is found (the fastest step seen is then no quiet reference);
- it tries the other count again every few seconds, the interval doubling while the decision
  holds (a quiet host pays a trial's slower steps rarely), and sooner when steps at full
  threads turn well slower than the fastest seen.

It acts only when nobody chose the thread count (`--threads`, NEFFKIT_ENGINE_THREADS,
OMP_NUM_THREADS) and one rank runs: the server's engine core and offline generation alike.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from statistics import fmean

WINDOW = 16  # steps at the held count whose mean is compared (a few stalls among them)
FIRST = 8  # steps at full threads before the first trial (each costs 2x beside a busy process)
SLOW = 1.8  # mean step at full threads / the fastest: try one fewer now
TRIAL_STEPS = 8  # steps a trial of the other count runs
FASTER = 0.9  # a trial's mean below this share of the held count's: switch
LOSING = 1.4  # a trial's mean above this share of the held count's: end it early
PROBE_EVERY_S = 5.0  # the first trial after a decision; doubles while decisions hold
PROBE_MAX_S = 40.0


class ThreadGovernor:
    def __init__(
        self,
        full: int,
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.full = full
        self.current = self.held = full  # the count running now; the count decided on
        self.set_threads, self.clock = set_threads, clock
        self.fastest: dict[str, float] = {}  # graph → its fastest step at full threads
        self.recent: dict[int, dict[str, deque[float]]] = {full: {}, full - 1: {}}
        self.trial = 0  # steps left in a trial of the other count
        self.interval = PROBE_EVERY_S
        self.next_trial = -math.inf  # the first trial: once FIRST steps ran at full threads
        self.decided_at = -math.inf
        self.reductions = 0  # times it settled on one thread fewer (run --json, tests)

    def observe(self, graph: str, seconds: float) -> None:
        """One decode step of `graph` took `seconds` at the current thread count."""
        if self.full <= 1:
            return
        times = self.recent[self.current].setdefault(graph, deque(maxlen=WINDOW))
        times.append(seconds)
        if self.current == self.full:
            self.fastest[graph] = min(self.fastest.get(graph, seconds), seconds)
        if self.trial:
            self.trial -= 1
            if not self.trial or self._losing():
                self._decide()
            return
        if len(times) < (WINDOW if self.decided_at > -math.inf else FIRST):
            return
        now = self.clock()
        fastest = self.fastest.get(graph, math.inf)
        slow = self.held == self.full and fmean(times) >= SLOW * fastest
        if now >= self.next_trial or (slow and now >= self.decided_at + PROBE_EVERY_S):
            self._start_trial()

    def _start_trial(self) -> None:
        other = self.full - 1 if self.held == self.full else self.full
        self.recent[other].clear()  # what it measured before is stale
        self.trial = TRIAL_STEPS
        self._set(other)

    def _ratio(self) -> float | None:
        """The trial's mean step over the held count's: per graph both ran (a server's batch
        moves between buckets during a trial), their geometric mean weighted by the trial's
        steps; None where no graph ran at both."""
        tried, held = self.recent[self.current], self.recent[self.held]
        pairs = [(fmean(t) / fmean(held[g]), len(t)) for g, t in tried.items() if t and held.get(g)]
        if not pairs:
            return None
        steps = sum(n for _, n in pairs)
        return math.exp(sum(n * math.log(r) for r, n in pairs) / steps)

    def _losing(self) -> bool:
        """Is the trial, two steps in, already far slower than the held count (end it early:
        on a quiet host one thread fewer is ~1.8x slower, and each trial step costs that)?"""
        ratio = self._ratio()
        return TRIAL_STEPS - self.trial >= 2 and ratio is not None and ratio > LOSING

    def _decide(self) -> None:
        """Keep the faster count (the held one where no graph ran at both); the interval to
        the next trial grows only while the held count wins clearly."""
        ratio, self.trial = self._ratio(), 0
        if ratio is not None and ratio < FASTER:
            self.held = self.current
            self.reductions += self.held < self.full
            self.interval = PROBE_EVERY_S
        else:
            self._set(self.held)
            clear = ratio is not None and ratio > LOSING
            self.interval = min(2 * self.interval, PROBE_MAX_S) if clear else PROBE_EVERY_S
        self.recent[self.held].clear()
        self.decided_at = self.clock()
        self.next_trial = self.decided_at + self.interval

    def _set(self, threads: int) -> None:
        self.current = threads
        self.set_threads(threads)


def default_governor(threads: int | None, full: int, ranks: int) -> ThreadGovernor | None:
    """A governor of `full` threads where nobody chose the count (`threads`, the environment)
    and one rank runs (ranks > 1 split the CPUs between them)."""
    import torch

    from neffkit.platform.cpus import chosen_threads

    if chosen_threads(threads) is not None or ranks > 1:
        return None
    return ThreadGovernor(full, torch.set_num_threads)
