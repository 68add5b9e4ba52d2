"""The build's trace stage: every graph on every rank, from the cache (early key) where it is
stored, otherwise traced in the build's workers (and lowered where the target compiles a lowered
form), then stored."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from neffkit.compile.cache.keys import trace_key
from neffkit.compile.jobs.workers import trace_job
from neffkit.compile.layout import projection_form
from neffkit.compile.units import BuildContext, TraceResult, job_key

if TYPE_CHECKING:
    from neffkit.compile.backends.base import Backend
    from neffkit.compile.cache import Cache
    from neffkit.compile.plan import Planned


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
    keys = (
        [
            trace_key(ctx.manifest, backend, s, r, projection_form(ctx.layout, s.rows * s.tokens))
            for s, r in pairs
        ]
        if cache
        else []
    )
    flat: list[TraceResult | None] = [_hit(cache.lookup_trace(k)) for k in keys] if cache else []
    flat = flat or [None] * len(pairs)
    misses = [i for i, t in enumerate(flat) if t is None]
    names = [
        pairs[i][0].name if world == 1 else f"{pairs[i][0].name}@rank{pairs[i][1]}" for i in misses
    ]
    if misses:
        ctx.progress.start("trace", names)
        args = [(ctx.layout, pairs[i][0], pairs[i][1], ctx.manifest.target) for i in misses]
        where = [job_key(*pairs[i]) for i in misses]
        traces = ctx.run_parallel(trace_job, args, names, ctx.progress, keys=where)
        for i, traced in zip(misses, traces, strict=True):
            flat[i] = traced
            if cache is not None:
                cache.store_trace(keys[i], traced)
    counters["traced"], counters["trace_hits"] = len(misses), len(pairs) - len(misses)
    done = [t for t in flat if t is not None]
    return [done[i * world : (i + 1) * world] for i in range(len(specs))]


def _hit(trace: TraceResult | None) -> TraceResult | None:
    """A cached trace cost no tracing this build."""
    return dataclasses.replace(trace, seconds=0.0) if trace is not None else None
