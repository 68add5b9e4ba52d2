"""The build orchestrator: manifest → plan → trace → check → audit → cache → compile → bundle.

`build()` reads as numbered steps, one function per stage, each taking and returning typed values
(compile/units.py). Tracing and compiling run in worker processes (tracing holds global state, so
processes, not threads). Compile workers retrace their graph and check its sha256 against the
traced one, so the artifact is provably built from the graph that was checked. Everything the
target does differently (lowering, compiler, verify runner, bundle fields) sits behind the
backend interface (compile/backends/base.py). Everything is written into a staging directory
renamed onto the destination only when the bundle is complete; an interrupt (Ctrl-C, SIGTERM)
terminates the workers and removes the staging directory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.bundle import (
    FindingRecord,
    JsonObject,
    staging_dir,
)
from neffkit.compile.audit import audit_units
from neffkit.compile.backends import get_backend
from neffkit.compile.backends.base import Backend
from neffkit.compile.cache import (
    lookup_units,
    open_cache,
    remember_unit,
    restore_unit,
    store_unit,
    trace_key,
)
from neffkit.compile.flags import ResolvedOptions, resolve_options
from neffkit.compile.plan import GraphSpec, make_plan
from neffkit.compile.progress import Progress
from neffkit.compile.spmd import RankTrace, SPMDMismatchError, check_spmd
from neffkit.compile.trace import ModelLayout, ensure_kernels, model_layout, uses_kernel
from neffkit.compile.units import BuildContext, GraphUnit, RunParallel, TraceResult
from neffkit.compile.verify import verify_units
from neffkit.compile.workers import trace_job, worker_pool
from neffkit.compile.write import write_bundle, write_weights
from neffkit.errors import BuildError
from neffkit.manifest import Manifest
from neffkit.models.projection import ProjectionPolicy

if TYPE_CHECKING:
    from neffkit.compile.cache import Cache

log = logging.getLogger(__name__)


@dataclass
class BuildResult:
    """What a build reports (`--json`): counters, seconds per stage and graph, peaks, findings."""

    bundle: Path | None
    counters: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    graphs: list[JsonObject] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    peak_rss_mb_by_stage: dict[str, float] = field(default_factory=dict)  # main, after each
    findings: list[FindingRecord] = field(default_factory=list)
    cluster_tasks: Counter[str] = field(default_factory=Counter)  # per Ray node (--cluster)

    def report(self) -> JsonObject:
        cluster = {"cluster_tasks_by_node": dict(self.cluster_tasks)} if self.cluster_tasks else {}
        return {
            **cluster,
            "bundle": str(self.bundle) if self.bundle else None,
            "counters": self.counters,
            "seconds": self.seconds,
            "graphs": self.graphs,
            "warnings": self.warnings,
            "peak_rss_mb": self.peak_rss_mb,
            "peak_rss_mb_by_stage": self.peak_rss_mb_by_stage,
            "findings": [f.to_json() for f in self.findings],
        }


def default_output(manifest: Manifest) -> Path:
    return Path("bundles") / manifest.name


def build(
    manifest: Manifest,
    output: Path | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
    cache: str | Path | None = None,
    dry_run: bool = False,
    lower_only: bool = False,
    verify: bool = False,
    shard: tuple[int, int] | None = None,
    cache_readonly: bool = False,
    cluster: str | None = None,
) -> BuildResult:
    """Build `manifest` into a bundle at `output` (or only report the plan with `dry_run`).

    `cache` (a directory or an fsspec URL; None disables it) is the artifact cache,
    `cache_readonly` reads it and writes nothing. `lower_only` (neuron) stops after lowering: the
    bundle holds HLO modules for `neffkit compile` to finish on a Neuron host. `verify` runs every
    graph against the eager model and records the result per graph. `shard=(k, n)` (a CI matrix
    job) traces and compiles only the k-th of n shares of the graphs into the cache and writes
    no bundle; a build without a shard then assembles the bundle from the cache. `cluster` (a
    Ray address) runs the trace and compile jobs as Ray tasks instead of local processes.
    """
    progress = progress or Progress(enabled=False)
    dest = Path(output) if output else default_output(manifest)
    result = BuildResult(bundle=None if dry_run else dest.resolve())
    backend = get_backend(manifest.target)
    backend.check_ready(lower_only, dry_run)
    # a lowered bundle compiles nothing, so there is nothing to cache
    store = open_cache(cache, cache_readonly) if cache and not lower_only else None
    clock = _Clock(result.seconds, result.peak_rss_mb_by_stage)
    if shard is not None and (store is None or store.readonly):
        raise BuildError(
            "--shard fills the artifact cache, and this build has none it may write "
            "(--no-cache, --cache-readonly or --lower-only)",
            hint="give every shard and the assembling build the same --cache",
        )
    with clock("plan"):  # 1. graphs, their resolved compiler options, the weights' shapes
        specs = plan_graphs(manifest, result, progress)
        if shard is not None:
            specs = shard_share(specs, *shard)
            result.counters["shard_graphs"] = len(specs)
        layout = target_layout(manifest, backend)
        if uses_kernel(layout) and not dry_run:  # graphs call it: verify runs them here
            ensure_kernels()
    with _pool(cluster, jobs, layout, result) as run_parallel:
        ctx = BuildContext(manifest, layout, run_parallel, progress, lower_only)
        with clock("trace"):  # 2. every graph on every rank, in parallel (unless cached)
            traces = trace_graphs(ctx, specs, backend, store, result.counters)
        with clock("check"):  # 3. byte-identical on every rank: one artifact serves all (SPMD)
            units = check_graphs(ctx, specs, traces, result.counters)
        with clock("audit"):  # 4. known neuronx-cc / runtime hazards
            result.findings = audit_units(manifest, units, progress, fail=not dry_run)
        with clock("cache"):  # 5. look each unit up by every factor that changes its artifact
            lookup_units(store, units, backend, manifest, progress)
        result.counters["cache_hits"] = sum(u.cached is not None for u in units)
        if dry_run:
            result.graphs = [_dry_run_row(u, store is not None) for u in units]
            return result
        if shard is not None:  # compile into the cache only: no weights, no bundle
            with tempfile.TemporaryDirectory(prefix="neffkit-shard-") as stage, clock("compile"):
                result.counters["compiled"] = compile_units(ctx, backend, store, Path(stage), units)
            result.bundle = None
            return _finished(result, units)
        with staging_dir(dest) as stage:
            with clock("weights"):  # 6. cast (and shard) into weights/rank{r}.safetensors
                weights, placed = write_weights(manifest, stage, layout, store)
                result.counters.update({f"weights_{k}": v for k, v in placed.items() if v})
            with clock("compile"):  # 7. compile the misses (in parallel); copy the hits
                result.counters["compiled"] = compile_units(ctx, backend, store, stage, units)
            if verify:  # 8. every graph against the eager model
                with clock("verify"):
                    verify_units(manifest, layout, backend, stage, units, progress)
            with clock("write"):  # 9. ir/, tokenizer/, bundle.json; renamed into place
                write_bundle(
                    manifest, layout, backend, stage, units, weights, result.findings, lower_only
                )
    return _finished(result, units)


def _finished(result: BuildResult, units: list[GraphUnit]) -> BuildResult:
    """The report's per-graph rows and peak memory, once the build's work is done."""
    result.graphs = [_report_row(u) for u in units]
    result.peak_rss_mb = _peak_rss_mb()
    return result


# ---------------------------------------------------------------- stages


def target_layout(manifest: Manifest, backend: Backend | None = None) -> ModelLayout:
    """The shapes every graph of this manifest is traced from, as its target traces them."""
    backend = backend or get_backend(manifest.target)
    return model_layout(manifest, backend.device, projection_policy(manifest, backend))


def projection_policy(manifest: Manifest, backend: Backend) -> ProjectionPolicy:
    """The backend's projection forms, with the cpu kernel as the manifest and host allow
    (`compiler.cpu_kernel: on` on a host without AVX-512 is an error; `auto` goes without)."""
    policy = backend.projection
    mode = manifest.compiler.cpu_kernel
    if backend.name != "cpu" or policy.lanes == 0 or mode == "off":
        return policy
    from neffkit import cpu_kernels

    if not cpu_kernels.supported():
        if mode == "on":
            raise BuildError(
                "compiler.cpu_kernel: on needs a CPU with "
                f"{', '.join(sorted(cpu_kernels.REQUIRED_FLAGS))}, which this host lacks",
                hint="use cpu_kernel: auto (or off)",
            )
        return policy
    return dataclasses.replace(policy, kernel=mode)


Planned = list[tuple[GraphSpec, ResolvedOptions]]


def graph_cost(spec: GraphSpec) -> int:
    """A graph's expected trace + compile cost, for balancing shards: the values it computes
    attention over (rows x tokens x context), plus a constant per graph."""
    return spec.rows * spec.tokens * spec.context + (1 << 16)


def shard_share(specs: Planned, k: int, n: int) -> Planned:
    """The k-th (1-based) of n shares: graphs dealt largest first to the least loaded share
    (ties by name), so every shard of one manifest computes the same assignment."""
    load = [0] * n
    owner: dict[str, int] = {}
    for spec, _ in sorted(specs, key=lambda p: (-graph_cost(p[0]), p[0].name)):
        i = min(range(n), key=lambda j: (load[j], j))
        owner[spec.name] = i
        load[i] += graph_cost(spec)
    return [(spec, options) for spec, options in specs if owner[spec.name] == k - 1]


def plan_graphs(manifest: Manifest, result: BuildResult, progress: Progress) -> Planned:
    """The plan's graphs with their resolved options; option warnings go into the report."""
    specs = [(spec, resolve_options(manifest, spec)) for spec in make_plan(manifest).graphs]
    for _, options in specs:
        result.warnings += options.warnings
    for warning in result.warnings:
        progress.message(f"warning: {warning}")
    result.counters.update(graphs=len(specs), traced=0, trace_hits=0, spmd_groups=0)
    result.counters.update(per_rank_graphs=0)
    result.counters.update(compiled=0, cache_hits=0)
    return specs


def trace_graphs(
    ctx: BuildContext,
    specs: Planned,
    backend: Backend,
    cache: Cache | None,
    counters: dict[str, int],
) -> list[list[TraceResult]]:
    """Per graph, one TraceResult per rank (lowered too where the backend compiles that form).

    With a cache, a (graph, rank) whose early key is stored is not traced: a warm rebuild with
    nothing changed traces nothing (`counters["traced"]` counts real traces)."""
    world = ctx.manifest.parallel.tp
    pairs = [(spec, r) for spec, _ in specs for r in range(world)]
    keys = [trace_key(ctx.manifest, backend, s, r) for s, r in pairs] if cache else []
    flat: list[TraceResult | None] = [_hit(cache.lookup_trace(k)) for k in keys] if cache else []
    flat = flat or [None] * len(pairs)
    misses = [i for i, t in enumerate(flat) if t is None]
    names = [pairs[i][0].name if world == 1 else f"{pairs[i][0].name}@rank{pairs[i][1]}"
             for i in misses]  # fmt: skip
    if misses:
        ctx.progress.start("trace", names)
        args = [(ctx.layout, pairs[i][0], pairs[i][1], ctx.manifest.target) for i in misses]
        for i, traced in zip(misses, ctx.run_parallel(trace_job, args, names, ctx.progress),
                             strict=True):  # fmt: skip
            flat[i] = traced
            if cache is not None:
                cache.store_trace(keys[i], traced)
    counters["traced"], counters["trace_hits"] = len(misses), len(pairs) - len(misses)
    done = [t for t in flat if t is not None]
    return [done[i * world : (i + 1) * world] for i in range(len(specs))]


def _hit(trace: TraceResult | None) -> TraceResult | None:
    """A cached trace cost no tracing this build."""
    return dataclasses.replace(trace, seconds=0.0) if trace is not None else None


def check_graphs(
    ctx: BuildContext, specs: Planned, traces: list[list[TraceResult]], counters: dict[str, int]
) -> list[GraphUnit]:
    """One unit per graph when every rank traced the same graph (and lowered form); else one per
    rank where the manifest allows per-rank artifacts, or SPMDMismatchError."""
    units: list[GraphUnit] = []
    for (spec, options), per_rank in zip(specs, traces, strict=True):
        try:
            _check_spmd(spec.name, per_rank)
        except SPMDMismatchError as exc:
            if not ctx.manifest.parallel.per_rank_artifacts:
                raise
            ctx.progress.message(
                f"warning: {exc.message.splitlines()[0]}; compiling one "
                "artifact per rank (parallel.per_rank_artifacts)"
            )
            units += [GraphUnit(spec, options, t, rank=r) for r, t in enumerate(per_rank)]
            counters["per_rank_graphs"] += 1
            continue
        units.append(GraphUnit(spec, options, per_rank[0]))
        counters["spmd_groups"] += len(per_rank) > 1
    for u in units:
        u.seconds["trace"] = u.trace.seconds
    return units


def _check_spmd(name: str, per_rank: list[TraceResult]) -> None:
    check_spmd(name, [RankTrace(r, t.graph_sha256, t.canonical_text, list(t.sources))
                      for r, t in enumerate(per_rank)])  # fmt: skip
    lowered = [t.lowered for t in per_rank]
    if all(lowered):  # the artifact is built from the lowered form: it must match too
        check_spmd(f"{name} (HLO)", [RankTrace(r, x.sha256, x.text, [])
                                     for r, x in enumerate(lowered) if x])  # fmt: skip


def compile_units(
    ctx: BuildContext,
    backend: Backend,
    cache: Cache | None,
    stage: Path,
    units: list[GraphUnit],
) -> int:
    """Misses through the backend's compiler, into the cache and graphs/; hits copied from the
    cache. Returns how many were compiled."""
    backend.write_inputs(stage, units)
    misses = [u for u in units if u.cached is None and not ctx.lower_only]
    for u, done in zip(misses, backend.compile(ctx, stage, misses) if misses else [], strict=True):
        u.seconds["compile"] = done.seconds
        u.metadata, u.compiler = done.metadata, done.compiler
        if cache is not None:
            store_unit(cache, u, done.artifact)
        _place(done.artifact, stage / "graphs" / f"{u.stem}{backend.artifact_suffix}")
    for u in units:
        if u.cached is not None:
            _place(u.cached, stage / "graphs" / f"{u.stem}{backend.artifact_suffix}", copy=True)
            restore_unit(u)
        if cache is not None:
            remember_unit(cache, ctx.manifest, u)
    shutil.rmtree(stage / "work", ignore_errors=True)
    return len(misses)


# ---------------------------------------------------------------- helpers


def _pool(
    cluster: str | None, jobs: int | None, layout: ModelLayout, result: BuildResult
) -> AbstractContextManager[RunParallel]:
    """The build's workers: local processes, or Ray tasks on `cluster`."""
    if cluster is None:
        return worker_pool(jobs or os.cpu_count() or 1)
    import torch

    from neffkit.compile.cluster import ray_pool, task_memory

    sizes = [math.prod(w.shape) * getattr(torch, w.dtype).itemsize for w in layout.weights]
    return ray_pool(cluster, task_memory(sum(sizes)), result.cluster_tasks)


class _Clock:
    """Seconds per stage, and the main process's peak RSS when each stage ends (the peak is
    monotonic, so the stage where it grows is the one that holds the memory)."""

    def __init__(self, seconds: dict[str, float], peak_rss_mb: dict[str, float]) -> None:
        self.seconds = seconds
        self.peak_rss_mb = peak_rss_mb

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = round(time.perf_counter() - t0, 3)
            self.peak_rss_mb[stage] = round(_peak_rss_mb()["main"], 1)


def _place(src: Path, dst: Path, copy: bool = False) -> None:
    if src == dst:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if copy:
        shutil.copyfile(src, dst)
    else:
        os.replace(src, dst)


def _report_row(u: GraphUnit) -> JsonObject:
    return {
        "name": u.stem,
        "cache": "hit" if u.cached else "miss",
        "miss_reason": u.miss_reason,
        "seconds": u.seconds,
        "graph_sha256": u.trace.graph_sha256,
    }


def _dry_run_row(u: GraphUnit, caching: bool) -> JsonObject:
    return {
        "name": u.spec.name,
        "phase": u.spec.phase,
        "buckets": {"rows": u.spec.rows, "tokens": u.spec.tokens, "context": u.spec.context},
        "options": u.options.inductor,
        "flags": list(u.options.flags),
        "cache": ("hit" if u.cached else "miss") if caching else "disabled",
        "miss_reason": u.miss_reason,
        "graph_sha256": u.trace.graph_sha256,
    }


def _peak_rss_mb() -> dict[str, float]:
    return {
        "main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
