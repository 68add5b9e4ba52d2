"""Hazard audit: rules known to break neuronx-cc or the runtime, run on graphs and flags.

Rules read a graph's canonical text (ir/), its inputs, io-alias map and rendered flags, so `build`
(on fresh traces) and `inspect` (on a shipped bundle) run exactly the same checks. Each finding has
a stable rule id, a severity, the graph and the node or flag it points at, and a one-line fix. The
knowledge comes from what vllm-neuron learned of neuronx-cc's failures (docs/inspect.md lists
them). Neuron graphs are also audited on their HLO module (hlo.py: NK30x), what neuronx-cc
actually reads. Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from neffkit.audit.graph import (
    BIG_MASK,
    CLAMPS,
    COLLECTIVES,
    HOST_READS,
    INDEX_MATH,
    LIMIT,
    GraphFacts,
    Node,
)
from neffkit.audit.hlo import hlo_hazards
from neffkit.audit.rules import RULES, Finding
from neffkit.contract.abi import Phase
from neffkit.targets import DTYPE_BYTES, E4M3_MAX, FP8_AS_E4M3_CHIPS, FP8_AS_E4M3_FLAG

if TYPE_CHECKING:
    pass


def _finding(rule: str, severity: str, g: GraphFacts, at: str, detail: str = "") -> Finding:
    r = RULES[rule]
    return Finding(rule, severity, g.name, at, r.title + (f": {detail}" if detail else ""), r.fix)


def _producers_reach(
    nodes: list[Node], start: int, goal: Callable[[Node], bool], stop: Callable[[Node], bool]
) -> bool:
    """Is there a producer path from node `start` to a node satisfying `goal` avoiding `stop`?"""
    seen, todo = set(), [start]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        node = nodes[i]
        if goal(node):
            return True
        if stop(node):
            continue
        todo.extend(node.refs)
    return False


def _kv_writes(g: GraphFacts) -> Iterator[Finding]:
    nodes = g.nodes
    for node in nodes:
        if not node.target.startswith("aten.index_put") or not node.refs:
            continue
        dest = nodes[node.refs[0]]
        if dest.target != "input" or not dest.name.startswith(
            ("k_cache.", "v_cache.", "kv_cache.")
        ):
            continue
        for ref in node.refs[1:-1]:  # the indices (last ref is the values)
            unclamped = _producers_reach(
                nodes,
                ref,
                goal=lambda n: n.target == "input" and n.name == "slot_mapping",
                stop=lambda n: n.target.startswith(CLAMPS),
            )
            via_math = _producers_reach(
                nodes, ref, lambda n: n.target.startswith(INDEX_MATH), lambda n: n.target == "input"
            )
            if unclamped and via_math:
                yield _finding("NK101", "error", g, node.text)
                break


def _embedding_gathers(g: GraphFacts) -> Iterator[Finding]:
    """A gather from the embedding table whose indices reach `input_ids` without a clamp."""
    nodes = g.nodes
    for node in nodes:
        if not node.target.startswith(("aten.index.Tensor", "aten.embedding")) or not node.refs:
            continue
        table = nodes[node.refs[0]]
        if table.target != "input" or "embed_tokens" not in table.name:
            continue
        for ref in node.refs[1:]:
            if _producers_reach(
                nodes,
                ref,
                goal=lambda n: n.target == "input" and n.name == "input_ids",
                stop=lambda n: n.target.startswith(CLAMPS),
            ):
                yield _finding("NK109", "error", g, node.text)
                break


def _collectives(g: GraphFacts) -> Iterator[Finding]:
    nodes = g.nodes
    outputs = next((n for n in nodes if n.target == "output"), None)
    user_outputs = set()
    if outputs is not None:
        aliased = len(g.io_alias)
        user_outputs = set(outputs.refs[aliased:])
    for node in nodes:
        if node.target.startswith(COLLECTIVES):
            src = nodes[node.refs[0]] if node.refs else None
            if src is not None and src.target == "input":
                sev = "error" if g.target == "neuron" else "warning"
                yield _finding("NK102", sev, g, node.text, f"reads {src.name}")
            if node.target.startswith("_c10d_functional.all_to_all") and (
                g.neuron_target == "trn2"
            ):
                yield _finding("NK108", "warning", g, node.text)
        if node.index in user_outputs:
            via = _producers_reach(
                nodes,
                node.index,
                lambda n: n.target.startswith(("_c10d_functional.",)),
                lambda n: not n.target.startswith(("aten.alias", "aten.view", "_c10d_functional.")),
            )
            if via:
                yield _finding("NK107", "error", g, node.text)


def _host_reads(g: GraphFacts) -> Iterator[Finding]:
    for node in g.nodes:
        if node.target.startswith(HOST_READS):
            yield _finding("NK103", "error", g, node.text)


def _aliasing(g: GraphFacts) -> Iterator[Finding]:
    names = [a.input for a in g.io_alias]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        yield _finding("NK104", "error", g, dup, "mutated twice through aliases")
    for node in g.nodes:
        if node.target.startswith("aten.as_strided") and _view_of_input(g.nodes, node):
            yield _finding("NK104", "error", g, node.text, "as_strided replay of a mutated base")
        if node.target == "input":
            nbytes = node.numel * DTYPE_BYTES.get(node.dtype, 4)
            if node.numel >= LIMIT or nbytes >= LIMIT:
                sev = "error" if g.target == "neuron" else "warning"
                yield _finding("NK105", sev, g, node.text, f"{node.name}: {nbytes} bytes")


_VIEWS = (
    "aten.view",
    "aten.reshape",
    "aten._unsafe_view",
    "aten.slice",
    "aten.select",
    "aten.expand",
    "aten.permute",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.alias",
    "aten.as_strided",
    "aten.t.",
    "aten.transpose",
)


def _view_of_input(nodes: list[Node], node: Node) -> bool:
    """Is `node` (through views only) a view of a graph input? Functionalization replays a
    mutated aliased input as an as_strided of its base; an as_strided of a computed value (the
    identity view models/projection.materialized writes) aliases no input."""
    base = nodes[node.refs[0]] if node.refs else None
    while base is not None and base.target.startswith(_VIEWS) and base.refs:
        base = nodes[base.refs[0]]
    return base is not None and base.target == "input"


def _bool_and(g: GraphFacts) -> Iterator[Finding]:
    """Boolean masks only: the hazard is a mask AND (an integer bitwise AND, such as a grammar
    bitmask's bit test, is another instruction)."""
    nodes = g.nodes
    for node in nodes:
        if not node.target.startswith(("aten.bitwise_and", "aten.logical_and", "aten.__and__")):
            continue
        if node.dtype not in ("bool", ""):
            continue
        shapes = [nodes[r].shape for r in node.refs[:2]]
        if node.numel >= BIG_MASK and len(shapes) == 2 and shapes[0] != shapes[1]:
            yield _finding("NK106", "warning", g, node.text, f"{shapes[0]} & {shapes[1]}")


CASTS = ("aten._to_copy", "prims.convert_element_type", "aten.to.")
FP8 = "float8_e4m3fn"
_CLAMP_BOUNDS = re.compile(r"^aten\.clamp\.default\(%\d+, (-?[\d.e+-]+), (-?[\d.e+-]+)\)")


def _fp8_casts(g: GraphFacts) -> Iterator[Finding]:
    """On trn1/trn2 every cast to fp8 must read a value clamped within ±240: the compiler reads
    e4m3fn as e4m3, whose largest value is 240 (NCC_EVRF051), so a wider value is not what the
    graph meant (docs/neuron.md#fp8-on-trainium)."""
    if g.target != "neuron" or g.neuron_target not in FP8_AS_E4M3_CHIPS:
        return
    for node in g.nodes:
        if node.dtype != FP8 or not node.target.startswith(CASTS) or not node.refs:
            continue
        src = g.nodes[node.refs[0]]
        if src.dtype == FP8:
            continue  # a copy of fp8 values, no conversion
        body = src.text.split(" = ", 1)[-1]
        bounds = _CLAMP_BOUNDS.match(body)
        if not bounds or float(bounds.group(1)) < -E4M3_MAX or float(bounds.group(2)) > E4M3_MAX:
            yield _finding(
                "NK202", "error", g, node.text, f"its input is not clamped to ±{E4M3_MAX:g}"
            )


def _flag_rules(g: GraphFacts) -> Iterator[Finding]:
    if g.target != "neuron":
        return
    h2t = [f for f in g.flags if f.startswith("--internal-hlo2tensorizer-options")]
    if len(h2t) > 1:
        yield _finding("NK203", "error", g, h2t[-1], f"{len(h2t)} occurrences")
    fp8 = any(n.dtype == FP8 for n in g.nodes)
    if fp8 and g.neuron_target in FP8_AS_E4M3_CHIPS and not any(FP8_AS_E4M3_FLAG in f for f in h2t):
        yield _finding(
            "NK202", "error", g, "--internal-hlo2tensorizer-options", f"{FP8_AS_E4M3_FLAG} missing"
        )
    model_type = next((f for f in g.flags if f.startswith("--model-type")), None)
    if model_type and g.flag_origins.get(model_type, "base") != "base":
        yield _finding("NK204", "warning", g, model_type, f"set by {g.flag_origins[model_type]}")
    levels = [f for f in g.flags if re.fullmatch(r"-O[123]", f)]
    if g.phase == Phase.DECODE and g.collectives and (not levels or levels[-1] != "-O3"):
        yield _finding("NK205", "warning", g, levels[-1] if levels else "(default -O)")


HLO_SEVERITY = {
    "NK301": "error",
    "NK302": "error",
    "NK303": "error",
    "NK304": "error",
    "NK305": "info",
}


def _hlo_rules(g: GraphFacts) -> Iterator[Finding]:
    """The rules on the HLO module itself (neuron graphs)."""
    if g.target != "neuron" or not g.hlo_text:
        return
    for hazard in hlo_hazards(g.hlo_text):
        yield _finding(hazard.rule, HLO_SEVERITY[hazard.rule], g, hazard.at, hazard.detail)


GRAPH_RULES = (
    _kv_writes,
    _embedding_gathers,
    _collectives,
    _host_reads,
    _aliasing,
    _bool_and,
    _fp8_casts,
    _flag_rules,
    _hlo_rules,
)


def audit_graph(g: GraphFacts, waive: tuple[str, ...] = ()) -> list[Finding]:
    findings = [f for rule in GRAPH_RULES for f in rule(g)]
    return [replace(f, waived=f.rule in waive) for f in findings]


def audit_buckets(target: str, prefill: list[int], waive: tuple[str, ...] = ()) -> list[Finding]:
    """Rules on the manifest alone (no tracing): bucket shapes for neuron."""
    out = []
    if target == "neuron":
        for b in prefill:
            if b % 128:
                r = RULES["NK201"]
                out.append(
                    Finding(
                        "NK201",
                        "warning",
                        "(manifest)",
                        f"buckets.prefill: {b}",
                        r.title,
                        r.fix,
                        "NK201" in waive,
                    )
                )
    return out


def blocking(findings: list[Finding]) -> list[Finding]:
    """Findings that fail a build: errors not waived by the manifest."""
    return [f for f in findings if f.severity == "error" and not f.waived]
