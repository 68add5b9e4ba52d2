"""SPMD check: every rank must trace a byte-identical graph so one compiled artifact serves all.

A difference means some rank-dependent value reached the graph as a Python constant (a rank int in
a slice, a per-rank shape). The error shows the graph, the ranks, a unified diff of the first
differing lines and the model source line that produced the first differing node.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from neffkit.compile.plan import Planned
from neffkit.compile.units import BuildContext, GraphUnit, TraceResult
from neffkit.errors import BuildError

DIFF_LINES = 12


class SPMDMismatchError(BuildError):
    """Ranks traced different graphs for the same (phase, bucket)."""

    default_hint = (
        "keep rank-dependent values in tensors, or set parallel.per_rank_artifacts: true "
        "(docs/parallelism.md#one-compile-for-every-rank-spmd)"
    )


@dataclass(frozen=True)
class RankTrace:
    rank: int
    graph_sha256: str
    canonical_text: str
    sources: list[str]


def check_spmd(graph: str, traces: list[RankTrace]) -> str:
    """Return the shared sha256, or raise SPMDMismatchError naming the first differing rank."""
    base = traces[0]
    for other in traces[1:]:
        if other.graph_sha256 != base.graph_sha256:
            raise SPMDMismatchError(
                _explain(graph, base, other),
                hint=(
                    "keep rank-dependent values in tensors (the graph's `rank` input), not "
                    "Python ints, and shard weights to equal names and shapes on every rank"
                ),
            )
    return base.graph_sha256


def _explain(graph: str, a: RankTrace, b: RankTrace) -> str:
    lines_a, lines_b = a.canonical_text.splitlines(), b.canonical_text.splitlines()
    first = next(
        (i for i, (x, y) in enumerate(zip(lines_a, lines_b, strict=False)) if x != y),
        min(len(lines_a), len(lines_b)),
    )
    diff = list(
        difflib.unified_diff(
            lines_a, lines_b, f"rank{a.rank}/{graph}", f"rank{b.rank}/{graph}", n=1, lineterm=""
        )
    )
    shown = "\n".join(diff[: DIFF_LINES + 3])
    more = "\n  …" if len(diff) > DIFF_LINES + 3 else ""
    source = a.sources[first] if first < len(a.sources) else ""
    source_b = b.sources[first] if first < len(b.sources) else ""
    where = source or source_b or "(unknown: the node carries no stack trace)"
    return (
        f"{graph}: ranks {a.rank} and {b.rank} traced different graphs; one artifact cannot "
        f"serve both (SPMD)\n{shown}{more}\nfirst differing node (line {first + 1}) comes "
        f"from: {where}"
    )


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
    check_spmd(
        name,
        [
            RankTrace(r, t.graph_sha256, t.canonical_text, list(t.sources))
            for r, t in enumerate(per_rank)
        ],
    )
    lowered = [t.lowered for t in per_rank]
    if all(lowered):  # the artifact is built from the lowered form: it must match too
        check_spmd(
            f"{name} (HLO)",
            [RankTrace(r, x.sha256, x.text, []) for r, x in enumerate(lowered) if x],
        )
