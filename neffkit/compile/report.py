"""What a build reports (`--json`): counters, seconds per stage and graph, peak memory, findings."""

from __future__ import annotations

import contextlib
import resource
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from neffkit.compile.progress import Progress
from neffkit.compile.units import GraphUnit
from neffkit.contract.codec import JsonObject
from neffkit.contract.records import FindingRecord


@dataclass
class BuildResult:
    """What a build reports (`--json`): counters, seconds per stage and graph, peaks, findings."""

    bundle: Path | None
    counters: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    graphs: list[JsonObject] = field(default_factory=list)
    graphs_before: list[JsonObject] = field(default_factory=list)  # the draft model's rows
    warnings: list[str] = field(default_factory=list)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    peak_rss_mb_by_stage: dict[str, float] = field(default_factory=dict)  # main, after each
    findings: list[FindingRecord] = field(default_factory=list)
    cluster_tasks: Counter[str] = field(default_factory=Counter)  # per Ray node (--cluster)

    def report(self) -> JsonObject:
        # copies as JSON values (dict and list are invariant: a dict[str, int] is no JsonObject)
        cluster: JsonObject = {}
        if self.cluster_tasks:
            cluster["cluster_tasks_by_node"] = dict(self.cluster_tasks)
        return {
            **cluster,
            "bundle": str(self.bundle) if self.bundle else None,
            "counters": dict(self.counters),
            "seconds": dict(self.seconds),
            "graphs": list(self.graphs),
            "warnings": list(self.warnings),
            "peak_rss_mb": dict(self.peak_rss_mb),
            "peak_rss_mb_by_stage": dict(self.peak_rss_mb_by_stage),
            "findings": [f.to_json() for f in self.findings],
        }


class Clock:
    """Seconds per stage, and the main process's peak RSS when each stage ends (the peak is
    monotonic, so the stage where it grows is the one that holds the memory)."""

    def __init__(
        self,
        seconds: dict[str, float],
        peak_rss_mb: dict[str, float],
        progress: Progress | None = None,
    ) -> None:
        self.seconds = seconds
        self.peak_rss_mb = peak_rss_mb
        self.progress = progress  # each stage shown while it runs

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            with self.progress.step(stage) if self.progress else contextlib.nullcontext():
                yield
        finally:
            self.seconds[stage] = round(time.perf_counter() - t0, 3)
            self.peak_rss_mb[stage] = round(peak_rss_mb()["main"], 1)


def report_row(u: GraphUnit) -> JsonObject:
    return {
        "name": u.stem,
        "cache": "hit" if u.cached else "miss",
        "miss_reason": u.miss_reason,
        "seconds": dict(u.seconds),
        "graph_sha256": u.trace.graph_sha256,
    }


def dry_run_row(u: GraphUnit, caching: bool) -> JsonObject:
    return {
        "name": u.spec.name,
        "phase": u.spec.phase,
        "buckets": {"rows": u.spec.rows, "tokens": u.spec.tokens, "context": u.spec.context},
        "options": dict(u.options.inductor),
        "flags": list(u.options.flags),
        "cache": ("hit" if u.cached else "miss") if caching else "disabled",
        "miss_reason": u.miss_reason,
        "graph_sha256": u.trace.graph_sha256,
    }


def peak_rss_mb() -> dict[str, float]:
    return {
        "main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
