"""The build's audit stage: every hazard rule (neffkit.audit) on every traced unit; errors the
manifest does not waive fail the build (a dry run only reports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from neffkit.audit.checks import audit_buckets, audit_graph, blocking
from neffkit.audit.graph import GraphFacts
from neffkit.audit.rules import Finding
from neffkit.errors import BuildError

if TYPE_CHECKING:
    from neffkit.compile.progress import Progress
    from neffkit.compile.units import GraphUnit
    from neffkit.manifest import Manifest


def audit_units(
    m: Manifest, units: list[GraphUnit], progress: Progress, fail: bool
) -> list[Finding]:
    """The build's audit: every rule on every unit; unwaived errors fail the build (a dry run
    only reports them)."""
    neuron = m.neuron.target if m.neuron else None
    findings = audit_buckets(m.target, list(m.buckets.prefill), m.audit.waive)
    for u in units:
        o = u.options
        hlo = u.trace.lowered.text if u.trace.lowered else None
        facts = GraphFacts(
            name=u.spec.name,
            phase=u.spec.phase,
            text=u.trace.canonical_text,
            io_alias=u.trace.io_alias,
            flags=o.flags,
            flag_origins=o.flag_origins,
            target=m.target,
            neuron_target=neuron,
            hlo_text=hlo,
        )
        findings += audit_graph(facts, m.audit.waive)
    for f in findings:
        if f.severity != "info":
            waived = " (waived)" if f.waived else ""
            progress.message(f"{f.severity}: {f.rule} {f.graph}: {f.message}{waived}")
    errors = blocking(findings)
    if errors and fail:
        first = errors[0]
        raise BuildError(
            f"{len(errors)} audit error(s); first: {first.rule} in "
            f"{first.graph}: {first.message} at `{first.at}`",
            hint=f"{first.fix}; or waive it with `audit: {{waive: [{first.rule}]}}`",
        )
    return findings
