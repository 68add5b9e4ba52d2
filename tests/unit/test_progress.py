"""A build and the test suite are never silent for long: the build's progress (plain text off a
terminal) prints a line per finished graph and, whenever nothing was printed for its heartbeat
interval, what runs and how far it is; the suite's controller prints what workers are making.
The interval is shortened here; the product's is 8 s (the acceptance: a line every 10 s)."""

from __future__ import annotations

import io
import time

from neffkit.compile import progress as build_progress
from tests.support import progress as test_progress


def test_a_build_step_and_a_graph_stage_beat_while_they_run(monkeypatch) -> None:
    monkeypatch.setattr(build_progress, "HEARTBEAT_S", 0.2)
    out = io.StringIO()
    bar = build_progress.Progress(stream=out)
    try:
        with bar.step("weights"):
            time.sleep(0.7)
            bar.start("compile", ["decode_b1", "prefill_t16"])
            bar.done("decode_b1", 1.5)
            time.sleep(0.7)
            bar.done("prefill_t16", 2.0)
    finally:
        bar.close()
    lines = out.getvalue().splitlines()
    assert any(line.startswith("  weights: ") for line in lines)
    assert "compile: 2 graph(s)" in lines and "  compile decode_b1: 1.5s" in lines
    beats = [line for line in lines if line.startswith("  compile: 1/2 graphs done")]
    assert beats and beats[0].endswith("s left")
    assert bar.status() == ""  # nothing runs after the build


def test_a_disabled_progress_prints_only_messages() -> None:
    out = io.StringIO()
    bar = build_progress.Progress(enabled=False, stream=out)
    with bar.step("trace"):
        bar.start("trace", ["a"])
        bar.done("a", 1.0)
        bar.message("warning: x")
    bar.close()
    assert out.getvalue() == "warning: x\n"


def test_the_suite_says_what_workers_make(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(test_progress, "HEARTBEAT_S", 0.2)
    path = tmp_path / "progress.log"
    said: list[str] = []
    reporter = test_progress.Reporter(path, said.append)
    reporter.start()
    monkeypatch.setenv(test_progress.ENV, str(path))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # lines say "main" then
    try:
        test_progress.note("making bundles/llama-1 (not in the test cache)")
        time.sleep(0.8)
        assert reporter.making and any("making bundles/llama-1 (" in s for s in said[1:])
        test_progress.note("made bundles/llama-1 in 3 s")
        time.sleep(0.4)
    finally:
        reporter.stop()
    assert said[0] == "neffkit tests [main]: making bundles/llama-1 (not in the test cache)"
    assert "neffkit tests [main]: made bundles/llama-1 in 3 s" in said
    assert not reporter.making
