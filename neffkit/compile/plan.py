"""Manifest → Plan: the ordered list of graphs to build. Pure Python; imports no torch.

One graph per (phase, token-or-batch bucket, context bucket), named `prefill_t128_c1024` and
`decode_b4_c1024`; prefill graphs of several rows (buckets.prefill_batch: packed prompts) are
`prefill_b4_t128_c1024`. A prefill chunk of T tokens needs a context bucket of at least T.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffkit.manifest import Manifest


@dataclass(frozen=True)
class GraphSpec:
    name: str
    phase: str  # "prefill" | "decode"
    rows: int  # sequences per call
    tokens: int  # tokens per sequence (1 for decode)
    context: int  # context bucket: tokens attended at most

    @property
    def bucket(self) -> int:
        """The phase's own bucket value: tokens for prefill, batch for decode."""
        return self.tokens if self.phase == "prefill" else self.rows

    def matches(self, match: dict) -> bool:
        """Per-graph rule matching on phase and bucket values or [lo, hi] ranges."""
        values = {"phase": self.phase, "context": self.context, "batch": self.rows}
        if self.phase == "prefill":
            values["tokens"] = self.tokens
        for key, want in match.items():
            have = values.get(key)
            if have is None:
                return False
            if isinstance(want, list):
                if not want[0] <= have <= want[1]:
                    return False
            elif have != want:
                return False
        return True


@dataclass(frozen=True)
class Plan:
    manifest: Manifest
    graphs: tuple[GraphSpec, ...]
    world_size: int


def graph_name(phase: str, bucket: int, context: int, rows: int = 1) -> str:
    if phase == "decode":
        return f"decode_b{bucket}_c{context}"
    return f"prefill_t{bucket}_c{context}" if rows == 1 else f"prefill_b{rows}_t{bucket}_c{context}"


def make_plan(manifest: Manifest) -> Plan:
    b = manifest.buckets
    graphs = [
        GraphSpec(graph_name("prefill", t, c, r), "prefill", r, t, c)
        for r in b.prefill_batch
        for t in b.prefill
        for c in b.context
        if t <= c
    ]
    graphs += [
        GraphSpec(graph_name("decode", n, c), "decode", n, 1, c)
        for n in b.decode
        for c in b.context
    ]
    return Plan(manifest=manifest, graphs=tuple(graphs), world_size=manifest.parallel.tp)
