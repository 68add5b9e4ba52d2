"""The thread governor on a scripted clock and scripted step times: it tries one thread fewer
after the first steps and keeps whichever count runs a graph faster, finds contention that is
there from the first step, tries again sooner when steps turn slow, backs off while a quiet
host keeps its full threads, and does nothing with one thread."""

from __future__ import annotations

from collections.abc import Callable

from neffkit.runtime.engine import governor as g

GRAPH = "decode_b8_c256"


class Host:
    """A clock and a step time per thread count (what the governor set)."""

    def __init__(self, gov_full: int = 2) -> None:
        self.now = 0.0
        self.calls: list[int] = []
        self.gov = g.ThreadGovernor(gov_full, self.calls.append, lambda: self.now)
        self.step: Callable[[int], float] = lambda threads: 0.010 if threads == 2 else 0.018

    def run(self, steps: int, graph: str = GRAPH) -> None:
        for _ in range(steps):
            seconds = self.step(self.gov.current)
            self.now += seconds
            self.gov.observe(graph, seconds)


def test_a_quiet_host_keeps_full_threads_and_tries_less_and_less_often() -> None:
    host = Host()
    host.run(g.FIRST - 1)
    assert host.calls == []
    host.run(1)
    assert host.calls == [1]  # the first trial of one thread fewer
    host.run(2)  # two steps show one thread is far slower: the trial ends there
    assert host.calls == [1, 2] and host.gov.held == 2 and host.gov.reductions == 0
    host.run(g.TRIAL_STEPS)
    assert host.calls == [1, 2]
    first = host.gov.interval
    host.now += first
    host.run(g.WINDOW + g.TRIAL_STEPS)  # the next trial, 5 s on: still slower
    assert host.calls == [1, 2, 1, 2] and host.gov.interval == 2 * first


def test_contention_from_the_first_step_is_found() -> None:
    """A busy neighbour from the start: full threads at 3x, one thread at 1.8x the quiet step
    (what bench/threads.py measures on 2 cores). No step at full threads is a quiet reference,
    so only trying one fewer can find it."""
    host = Host()
    host.step = lambda threads: 0.030 if threads == 2 else 0.018
    host.run(g.FIRST + g.TRIAL_STEPS)
    assert host.calls == [1] and host.gov.held == 1 and host.gov.reductions == 1
    host.run(200)  # nothing changes until the next trial is due
    assert host.calls == [1]


def test_contention_arriving_later_is_tried_early_and_leaving_restores_full() -> None:
    host = Host()
    host.run(g.FIRST + g.TRIAL_STEPS)  # quiet: full threads held, next trial in 10 s
    assert host.gov.held == 2
    host.now += 1.0
    host.step = lambda threads: 0.030 if threads == 2 else 0.018
    host.run(g.WINDOW)  # still before the trial is due: too soon after the decision
    assert host.calls == [1, 2]
    host.now += g.PROBE_EVERY_S
    host.run(g.WINDOW + g.TRIAL_STEPS)
    assert host.gov.held == 1 and host.gov.current == 1
    host.step = lambda threads: 0.010 if threads == 2 else 0.018  # the neighbour leaves
    host.now += g.PROBE_EVERY_S
    host.run(1 + g.TRIAL_STEPS)
    assert host.gov.held == 2 and host.gov.current == 2


def test_each_graph_is_compared_with_itself() -> None:
    """A trial that ends on a graph the held count has not run keeps the held count; a bigger
    bucket's slower steps are not contention."""
    host = Host()
    host.run(g.FIRST, "decode_b1_c256")
    host.run(g.TRIAL_STEPS, "decode_b8_c256")
    assert host.gov.held == 2 and host.calls == [1, 2]
    host.step = lambda threads: 0.025
    host.now += 1.0
    host.run(4 * g.WINDOW, "decode_b8_c256")  # slower, but never slower than its own fastest
    assert host.calls == [1, 2]


def test_one_thread_has_nothing_to_give() -> None:
    host = Host(gov_full=1)
    host.step = lambda threads: 0.1
    host.run(4 * g.WINDOW)
    assert host.calls == []


def test_a_trial_whose_batch_changes_bucket_still_decides() -> None:
    """A server's batch shrinks mid-trial (decode_b8 → decode_b4): the trial is judged on the
    graphs both counts ran, not left undecided on the one it ended on."""
    host = Host()
    host.step = lambda threads: 0.030 if threads == 2 else 0.018  # contended from the start
    host.run(g.FIRST, "decode_b8_c256")
    assert host.calls == [1]
    host.run(g.TRIAL_STEPS // 2, "decode_b8_c256")
    host.run(g.TRIAL_STEPS // 2, "decode_b4_c256")  # no b4 steps at full threads to compare
    assert host.gov.held == 1 and host.calls == [1]
