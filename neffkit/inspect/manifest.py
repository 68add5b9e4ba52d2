"""A manifest inspected before building: the flag and bucket rules, with no tracing."""

from __future__ import annotations

from collections import Counter
from typing import Any

from neffkit.audit.checks import audit_buckets, audit_graph
from neffkit.audit.graph import GraphFacts
from neffkit.audit.rules import RULES
from neffkit.inspect.bundle import INSPECT_SCHEMA_VERSION


def inspect_manifest(path: str) -> dict[str, Any]:
    """The flag and bucket rules on a manifest, before any build (no tracing, no torch)."""
    from neffkit.compile.flags import resolve_options
    from neffkit.compile.plan import make_plan
    from neffkit.manifest import load_manifest

    m = load_manifest(path)
    plan = make_plan(m)
    findings = audit_buckets(m.target, list(m.buckets.prefill), m.audit.waive)
    graphs = []
    for spec in plan.graphs:
        opts = resolve_options(m, spec)
        facts = GraphFacts(
            name=spec.name,
            phase=spec.phase,
            text="",
            io_alias=(),
            flags=opts.flags,
            flag_origins=opts.flag_origins,
            target=m.target,
            neuron_target=m.neuron.target if m.neuron else None,
            collectives=m.parallel.tp > 1,
        )  # no graph yet: tp > 1 means collectives
        found = [f for f in audit_graph(facts, m.audit.waive) if f.rule.startswith("NK2")]
        findings += found
        graphs.append(
            {
                "name": spec.name,
                "flags": list(opts.flags),
                "options": opts.inductor,
                "warnings": list(opts.warnings),
            }
        )
    counts = Counter(f.severity for f in findings if not f.waived)
    b = m.buckets
    return {
        "schema": INSPECT_SCHEMA_VERSION,
        "manifest": str(path),
        "target": m.target,
        "graphs": graphs,
        "findings": [f.to_json() for f in findings],
        "finding_counts": {s: counts.get(s, 0) for s in ("error", "warning", "info")},
        # what was looked at, so an empty findings list reads as "checked, clean", not "skipped"
        "checked": {
            "rules": [r for r in RULES if r.startswith("NK2")],
            "buckets": {
                "prefill": list(b.prefill),
                "decode": list(b.decode),
                "context": list(b.context),
                "prefill_batch": list(b.prefill_batch),
            },
            "flags": sorted({f for g in graphs for f in g["flags"]}),
            "waived": list(m.audit.waive),
        },
    }
