"""Manifest → Plan: the ordered list of graphs to build. Pure Python; imports no torch.

One graph per (phase, token-or-batch bucket, context bucket), named `prefill_t128_c1024` and
`decode_b4_c1024`; prefill graphs of several rows (buckets.prefill_batch: packed prompts) are
`prefill_b4_t128_c1024`. A prefill chunk of T tokens needs a context bucket of at least T. With
`speculation`, a verify graph of 1 + K tokens a row per decode bucket up to its max_batch and
context bucket: `verify_b4_k4_c1024`. An embed manifest (manifest/task.py) has prefill graphs only.
"""

from __future__ import annotations

from neffkit.compile.units import GraphSpec, Plan, ResolvedOptions
from neffkit.contract.abi import GraphKey, Phase
from neffkit.manifest import Manifest


def make_plan(manifest: Manifest) -> Plan:
    b = manifest.buckets
    graphs = [
        GraphSpec.of(GraphKey(Phase.PREFILL, r, t, c))
        for r in b.prefill_batch
        for t in b.prefill
        for c in b.context
        if t <= c
    ]
    if manifest.embedding is not None:  # pooled hidden states: nothing is decoded
        return Plan(manifest=manifest, graphs=tuple(graphs), world_size=manifest.parallel.tp)
    graphs += [GraphSpec.of(GraphKey(Phase.DECODE, n, 1, c)) for n in b.decode for c in b.context]
    spec = manifest.speculation
    if spec is not None:
        k = spec.num_tokens
        graphs += [
            GraphSpec.of(GraphKey(Phase.VERIFY, n, 1 + k, c))
            for n in b.decode
            if n <= spec.max_batch
            for c in b.context
            if 1 + k < c
        ]
    return Plan(manifest=manifest, graphs=tuple(graphs), world_size=manifest.parallel.tp)


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
