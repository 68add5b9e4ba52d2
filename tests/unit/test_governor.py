"""The thread governor on a scripted clock: full threads while steps run near the fastest, one
fewer once the median of recent steps is well above it, full again when a probe finds the host
quiet, and nothing at all with one thread."""

from __future__ import annotations

from neffkit.runtime.engine import governor as g


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _governor(full: int = 2):
    clock, calls = Clock(), []
    return g.ThreadGovernor(full, calls.append, clock), clock, calls


def test_contention_drops_a_thread_and_a_quiet_probe_restores_it() -> None:
    gov, clock, calls = _governor()
    for _ in range(20):  # quiet: 10 ms steps, a few noisy ones
        gov.observe("decode_b8_c256", 0.010)
    gov.observe("decode_b8_c256", 0.030)
    assert calls == [] and gov.current == 2
    for _ in range(g.WINDOW):  # a busy neighbour: steps at 3x
        gov.observe("decode_b8_c256", 0.030)
    assert calls == [1] and gov.current == 1 and gov.reductions == 1
    for _ in range(50):  # at one thread nothing is compared until the probe is due
        gov.observe("decode_b8_c256", 0.015)
    assert calls == [1]
    clock.now += g.PROBE_EVERY_S
    gov.observe("decode_b8_c256", 0.015)  # the probe starts: full threads
    assert calls == [1, 2]
    for _ in range(g.PROBE_STEPS):  # still busy: back to one thread
        gov.observe("decode_b8_c256", 0.031)
    assert calls == [1, 2, 1]
    clock.now += g.PROBE_EVERY_S
    gov.observe("decode_b8_c256", 0.015)
    for _ in range(g.PROBE_STEPS):  # quiet again: full threads stay
        gov.observe("decode_b8_c256", 0.0105)
    assert calls == [1, 2, 1, 2] and gov.current == 2


def test_each_graph_is_compared_with_its_own_fastest_step() -> None:
    gov, _, calls = _governor()
    for _ in range(4 * g.WINDOW):  # a bigger bucket is slower, not contended
        gov.observe("decode_b1_c256", 0.010)
        gov.observe("decode_b8_c256", 0.025)
    assert calls == []


def test_one_thread_has_nothing_to_give() -> None:
    gov, _, calls = _governor(full=1)
    for _ in range(4 * g.WINDOW):
        gov.observe("decode_b1_c256", 0.010 if _ < 4 else 0.1)
    assert calls == []
