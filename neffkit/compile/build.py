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

import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.compile.audit import audit_units
from neffkit.compile.autotune import autotuned
from neffkit.compile.backends import get_backend
from neffkit.compile.backends.base import Backend
from neffkit.compile.cache import open_cache
from neffkit.compile.cache.lookup import lookup_units, remember_unit, restore_unit, store_unit
from neffkit.compile.calibrate import calibrated
from neffkit.compile.flags import resolve_options
from neffkit.compile.jobs.workers import worker_pool
from neffkit.compile.layout import target_layout, uses_kernel
from neffkit.compile.plan import Planned, make_plan, shard_share
from neffkit.compile.progress import Progress
from neffkit.compile.report import BuildResult, Clock, dry_run_row, peak_rss_mb, report_row
from neffkit.compile.spmd import check_graphs
from neffkit.compile.trace import ensure_kernels
from neffkit.compile.tracing import trace_graphs
from neffkit.compile.units import (
    BuildContext,
    GraphUnit,
    ModelLayout,
    RunParallel,
)
from neffkit.compile.verify.run import verify_units
from neffkit.compile.write import DRAFT_DIR, write_bundle, write_weights
from neffkit.contract.staging import staging_dir
from neffkit.errors import BuildError
from neffkit.manifest import Manifest
from neffkit.manifest.draft import draft_manifest
from neffkit.platform.cpus import usable_cpus

if TYPE_CHECKING:
    from neffkit.compile.cache import Cache

log = logging.getLogger(__name__)


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
    args = (jobs, progress, cache, dry_run, lower_only, verify)
    if _has_draft(manifest) and shard is None:  # 0. the draft model's own bundle, first
        with _draft_build(dest, dry_run) as draft:
            inner = build(draft_manifest(manifest), draft, *args, None, cache_readonly, cluster)
            _add_draft_report(result, inner)
            built = None if dry_run else draft
            return _target_build(
                manifest, dest, result, *args, shard, cache_readonly, cluster, built
            )
    return _target_build(manifest, dest, result, *args, shard, cache_readonly, cluster, None)


def _target_build(
    manifest: Manifest,
    dest: Path,
    result: BuildResult,
    jobs: int | None,
    progress: Progress,
    cache: str | Path | None,
    dry_run: bool,
    lower_only: bool,
    verify: bool,
    shard: tuple[int, int] | None,
    cache_readonly: bool,
    cluster: str | None,
    draft: Path | None,
) -> BuildResult:
    """Steps 1-9 for the manifest's own model; `draft` (a built draft bundle) goes inside."""
    backend = get_backend(manifest.target)
    backend.check_ready(lower_only, dry_run)
    store = _open_store(cache, cache_readonly, shard, lower_only)
    clock = Clock(result.seconds, result.peak_rss_mb_by_stage, progress)
    with clock("plan"):  # 1. graphs, their resolved compiler options, the weights' shapes
        specs = plan_graphs(manifest, result, progress)
        if shard is not None:
            specs = shard_share(specs, *shard)
            result.counters["shard_graphs"] = len(specs)
        layout = target_layout(manifest, backend)
        if uses_kernel(layout) and not dry_run:  # graphs call it: verify runs them here
            ensure_kernels()
            layout = _measured_forms(layout, specs, progress, result)
    with _pool(cluster, jobs, layout, result) as run_parallel:
        ctx = BuildContext(manifest, layout, run_parallel, progress, lower_only)
        units = _checked_units(ctx, specs, backend, store, result, clock, fail=not dry_run)
        if dry_run:
            rows = [dry_run_row(u, store is not None) for u in units]
            result.graphs = [*result.graphs_before, *rows]
            return result
        if shard is not None:  # compile into the cache only: no weights, no bundle
            with tempfile.TemporaryDirectory(prefix="neffkit-shard-") as stage, clock("compile"):
                result.counters["compiled"] = compile_units(ctx, backend, store, Path(stage), units)
            result.bundle = None
            return _finished(result, units)
        _write(ctx, backend, store, dest, units, result, clock, verify, draft)
    return _finished(result, units)


def _measured_forms(
    layout: ModelLayout, specs: Planned, progress: Progress, result: BuildResult
) -> ModelLayout:
    """cpu_kernel auto: each graph's row count takes the kernel only where it measured faster
    here than Inductor's form (compile/autotune.py); timed before any worker runs."""
    if layout.projection.kernel != "auto":
        return layout
    rows = sorted({s.rows * s.tokens for s, _ in specs})
    try:
        with progress.stage("autotune", [f"{r} rows" for r in rows], unit="row count"):
            layout, timings = autotuned(layout, rows, lambda t: progress.done(f"{t.rows} rows"))
    except Exception as exc:  # a measurement is an optimisation: the build goes on without it
        result.warnings.append(f"cpu_kernel auto: timing the forms failed ({exc}); unmeasured")
        return layout
    for t in timings if progress.enabled else ():
        progress.message(
            f"{t.rows} rows: projections {t.kernel_ms:.2f} ms with neffkit's kernel for "
            f"weights of 1 MiB or more, {t.kernel_all_ms:.2f} ms for every weight, "
            f"{t.inductor_ms:.2f} ms in Inductor's form: {t.chosen}"
        )
    return layout


def _has_draft(manifest: Manifest) -> bool:
    spec = manifest.speculation
    return spec is not None and spec.method in ("draft", "mtp")


@contextmanager
def _draft_build(dest: Path, dry_run: bool) -> Iterator[Path]:
    """A directory beside the destination for the draft's bundle (moved into the target's
    staging directory before it is renamed into place), removed whatever happens; a dry run
    writes nothing."""
    if dry_run:
        yield dest / DRAFT_DIR
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.draft-", dir=dest.parent) as tmp:
        yield Path(tmp) / DRAFT_DIR


def _add_draft_report(result: BuildResult, inner: BuildResult) -> None:
    """The draft's graphs and counts in the target's report, under `draft/` and `draft_*`."""
    result.graphs_before = [{**row, "name": f"{DRAFT_DIR}/{row['name']}"} for row in inner.graphs]
    for name, value in inner.counters.items():
        result.counters[f"draft_{name}"] = value
    result.warnings += [f"draft: {w}" for w in inner.warnings]
    result.findings += inner.findings


def _open_store(
    cache: str | Path | None, readonly: bool, shard: tuple[int, int] | None, lower_only: bool
) -> Cache | None:
    """The artifact cache the build reads (and writes, unless read-only); None without one."""
    store = open_cache(cache, readonly) if cache else None
    if shard is not None and (store is None or store.readonly or lower_only):
        raise BuildError(
            "--shard fills the artifact cache, and this build has none it may write "
            "(--no-cache, --cache-readonly or --lower-only)",
            hint="give every shard and the assembling build the same --cache",
        )
    return store


def _artifacts(ctx: BuildContext, store: Cache | None) -> Cache | None:
    """The cache of compiled artifacts; a lowered bundle compiles nothing, so it reads and
    stores only traces (with their HLO) and weight shards."""
    return None if ctx.lower_only else store


def _checked_units(
    ctx: BuildContext,
    specs: Planned,
    backend: Backend,
    store: Cache | None,
    result: BuildResult,
    clock: Clock,
    fail: bool,
) -> list[GraphUnit]:
    """Steps 2-5: the graphs traced, checked SPMD, audited and looked up in the cache."""
    with clock("trace"):  # 2. every graph on every rank, in parallel (unless cached)
        traces = trace_graphs(ctx, specs, backend, store, result.counters)
    with clock("check"):  # 3. byte-identical on every rank: one artifact serves all (SPMD)
        units = check_graphs(ctx, specs, traces, result.counters)
    with clock("audit"):  # 4. known neuronx-cc / runtime hazards
        result.findings = audit_units(ctx.manifest, units, ctx.progress, fail=fail)
    with clock("cache"):  # 5. look each unit up by every factor that changes its artifact
        lookup_units(_artifacts(ctx, store), units, backend, ctx.manifest, ctx.progress)
    result.counters["cache_hits"] = sum(u.cached is not None for u in units)
    return units


def _write(
    ctx: BuildContext,
    backend: Backend,
    store: Cache | None,
    dest: Path,
    units: list[GraphUnit],
    result: BuildResult,
    clock: Clock,
    verify: bool,
    draft: Path | None,
) -> None:
    """Steps 6-9, in a staging directory renamed onto `dest` only when the bundle is complete."""
    manifest, layout = ctx.manifest, ctx.layout
    with staging_dir(dest) as stage:
        if draft is not None:  # hashed into bundle.json's files with the target's own
            os.replace(draft, stage / DRAFT_DIR)
        with clock("weights"):  # 6. cast (and shard) into weights/rank{r}.safetensors
            layout = calibrated(manifest, layout)  # fp8 KV scales the checkpoint lacks
            weights, placed = write_weights(manifest, stage, layout, store)
            result.counters.update({f"weights_{k}": v for k, v in placed.items() if v})
        with clock("compile"):  # 7. compile the misses (in parallel); copy the hits
            artifacts = _artifacts(ctx, store)
            result.counters["compiled"] = compile_units(ctx, backend, artifacts, stage, units)
        if verify:  # 8. every graph against the eager model
            with clock("verify"):
                verify_units(manifest, layout, backend, stage, units, ctx.progress)
        with clock("write"):  # 9. ir/, tokenizer/, bundle.json; renamed into place
            write_bundle(
                manifest, layout, backend, stage, units, weights, result.findings, ctx.lower_only
            )


def _finished(result: BuildResult, units: list[GraphUnit]) -> BuildResult:
    """The report's per-graph rows and peak memory, once the build's work is done."""
    result.graphs = [*result.graphs_before, *(report_row(u) for u in units)]
    result.peak_rss_mb = peak_rss_mb()
    return result


# ---------------------------------------------------------------- stages


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
        return worker_pool(jobs or usable_cpus())
    import torch

    from neffkit.compile.jobs.cluster import ray_pool, task_memory

    sizes = [math.prod(w.shape) * getattr(torch, w.dtype).itemsize for w in layout.weights]
    return ray_pool(cluster, task_memory(sum(sizes)), result.cluster_tasks)


def _place(src: Path, dst: Path, copy: bool = False) -> None:
    if src == dst:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if copy:
        shutil.copyfile(src, dst)
    else:
        os.replace(src, dst)
