"""Autotune on a noisy host (compile/autotune.py): a measurement runs more rounds while no form
wins by NOISE, keeps the default form (the kernel) when none does, records its margin, and a
thin kept margin is measured again, the forms' means pooled, up to MAX_MEASUREMENTS. Timed on
a scripted clock: each form's run advances it by that form's scripted time."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from neffkit.compile import autotune
from neffkit.compile.units import NOISE, FormTiming


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _runs(clock: Clock, seconds: dict[str, Callable[[int], float]], calls: list[str]):
    """One run per form, advancing the clock by seconds[form](its call count)."""

    def run_of(form: str) -> Callable[[], None]:
        def run() -> None:
            calls.append(form)
            clock.now += seconds[form](calls.count(form))

        return run

    return {form: run_of(form) for form in seconds}


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(autotune.time, "perf_counter", clock)
    return clock


def test_a_clear_winner_takes_one_round(clock) -> None:
    calls: list[str] = []
    seconds = {"kernel": lambda n: 0.010, "kernel-all": lambda n: 0.011, "inductor": lambda n: 0.02}
    ms = autotune.timed_forms(_runs(clock, seconds, calls), 1.0)
    assert len(calls) == 3 * autotune.REPEATS
    assert autotune.margin_of(ms) == pytest.approx(0.1)


def test_forms_within_noise_take_every_round_and_keep_the_default(clock) -> None:
    calls: list[str] = []
    # Inductor's form 2% faster: noise on a shared host, not a reason to leave the default
    seconds = {
        "kernel": lambda n: 0.0100,
        "kernel-all": lambda n: 0.0103,
        "inductor": lambda n: 0.0098,
    }
    ms = autotune.timed_forms(_runs(clock, seconds, calls), 1.0)
    assert len(calls) == 3 * autotune.REPEATS * autotune.MAX_ROUNDS
    timing = FormTiming(1, ms["kernel"], ms["inductor"], ms["kernel-all"])
    assert timing.margin < NOISE and timing.chosen == "kernel"
    assert FormTiming(1, 10.0, 8.0, 11.0).chosen == "inductor"


def test_a_noisy_first_rounds_winner_is_measured_again(clock) -> None:
    """A form that looked 3% faster in the first round and is not: more rounds pool the
    samples until the real order shows."""
    calls: list[str] = []
    seconds = {
        "kernel": lambda n: 0.0100,
        "kernel-all": lambda n: 0.0200,
        "inductor": lambda n: 0.0097 if n <= autotune.REPEATS else 0.0125,
    }
    ms = autotune.timed_forms(_runs(clock, seconds, calls), 1.0)
    assert len(calls) > 3 * autotune.REPEATS
    assert min(ms, key=ms.__getitem__) == "kernel" and autotune.margin_of(ms) >= NOISE


def test_thin_kept_margins_are_measured_again_and_pooled() -> None:
    thin = FormTiming(8, 10.0, 10.8, 12.0)  # margin 0.08
    assert autotune.remeasure(thin)
    again = autotune.merged(thin, FormTiming(8, 10.0, 11.6, 12.0))
    assert again.measurements == 2 and again.inductor_ms == pytest.approx(11.2)
    assert again.margin == pytest.approx(0.12) and not autotune.remeasure(again)
    worn = FormTiming(8, 10.0, 10.1, 12.0, autotune.MAX_MEASUREMENTS)
    assert not autotune.remeasure(worn)
    assert not autotune.remeasure(FormTiming(8, 10.0, 13.0, 12.0))
