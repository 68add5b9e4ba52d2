"""Hazard audit: rules known to break neuronx-cc or the runtime, run on graphs and flags.

Rules read a graph's canonical text (ir/), its inputs, io-alias map and rendered flags, so `build`
(on fresh traces) and `inspect` (on a shipped bundle) run exactly the same checks. Each finding has
a stable rule id, a severity, the graph and the node or flag it points at, and a one-line fix. The
knowledge comes from the vllm-neuron field notes (seed 000, sections 2, 4-7). Neuron graphs are also
audited on their HLO module (hlo_audit.py: NK30x), what neuronx-cc actually reads. Pure Python.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from neffkit.bundle import FindingRecord, IoAlias
from neffkit.compile.hlo_audit import hlo_hazards
from neffkit.errors import BuildError
from neffkit.targets import DTYPE_BYTES, E4M3_MAX, FP8_AS_E4M3_CHIPS, FP8_AS_E4M3_FLAG

if TYPE_CHECKING:
    from neffkit.compile.progress import Progress
    from neffkit.compile.units import GraphUnit
    from neffkit.manifest import Manifest

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    fix: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in [
        Rule(
            "NK101",
            "KV write with slot indices not clamped before // or %",
            "clamp slot_mapping to >= 0 (the null block) before computing block and offset",
        ),
        Rule(
            "NK102",
            "collective reads a graph input directly (NCC_INLA001)",
            "copy the input into an intermediate tensor before the collective",
        ),
        Rule(
            "NK103",
            "data-dependent host read in the graph (.item(), nonzero, ...)",
            "keep values on device; move host decisions to metadata built with numpy",
        ),
        Rule(
            "NK104",
            "aliased or overlapping mutated inputs (synthetic base, as_strided replay)",
            "allocate one tensor per layer for K and V; never pass views of one buffer",
        ),
        Rule(
            "NK105",
            "input tensor with 2**32 or more elements or bytes (offset truncation)",
            "split the tensor (e.g. per-layer KV caches) so no input reaches 2**32",
        ),
        Rule(
            "NK106",
            "broadcast boolean AND of a large mask with a [1, N] mask (CHRS-985)",
            "fold validity into positions and use a single comparison or where",
        ),
        Rule(
            "NK107",
            "a collective's result is a graph output (deadlocks the next call under gloo)",
            "feed collective results into later ops (e.g. the residual add), never return them",
        ),
        Rule(
            "NK108",
            "all_to_all on trn2 is emulated (all_gather + slice)",
            "prefer an all-reduce formulation (experts computed densely per rank)",
        ),
        Rule(
            "NK109",
            "embedding gather with token ids not clamped to the vocabulary",
            "clamp input_ids to [0, vocab) before the gather: an out-of-range id is an "
            "out-of-bounds DMA on Neuron and a crash on CPU",
        ),
        Rule(
            "NK201",
            "prefill bucket not a multiple of 128 (NCC_INKI016 for NKI attention)",
            "use prefill buckets that are multiples of 128 on neuron",
        ),
        Rule(
            "NK202",
            "fp8 e4m3fn on trn1/trn2: the e4m3fn-as-e4m3 flag and a ±240 clamp before every "
            "fp8 cast (NCC_EVRF051)",
            "add --experimental-unsafe-fp8e4m3fn-as-fp8e4m3 inside the single "
            "--internal-hlo2tensorizer-options string, and clamp(x, -240, 240) right before "
            "each cast to float8_e4m3fn (e4m3 has no values past 240)",
        ),
        Rule(
            "NK203",
            "more than one --internal-hlo2tensorizer-options (neuronx-cc keeps the last)",
            "merge all hlo2tensorizer options into one string (neffkit's flag model does this)",
        ),
        Rule(
            "NK204",
            "an injected --model-type is overridden",
            "check that the override is intended; neuronx-cc keeps the last --model-type",
        ),
        Rule(
            "NK205",
            "decode graph with collectives compiled below -O3 (modular flow wraps each)",
            "compile decode graphs with -O3 (a per_graph rule: {match: {phase: decode}})",
        ),
        Rule(
            "NK301",
            "f64 value in the HLO module (Trainium has no 64-bit floating point)",
            "find the torch op that lowered through float64 (floor division, float() of an "
            "int64) and keep it in integers or float32",
        ),
        Rule(
            "NK302",
            "HLO collective reads an entry parameter (NCC_INLA001)",
            "copy the input into an intermediate tensor before the collective",
        ),
        Rule(
            "NK303",
            "HLO gather/scatter indices reach a parameter without a clamp",
            "clamp indices from the host (token ids, slots, positions, ranks) into range in "
            "the graph: an out-of-range index is an out-of-bounds DMA on Neuron",
        ),
        Rule(
            "NK304",
            "HLO value of 2**32 or more elements (offset truncation)",
            "split the tensor so no value reaches 2**32 elements",
        ),
        Rule(
            "NK305",
            "HLO opcode not in the documented XLA operator list (neuron-cc-ops-xla)",
            "none needed if neuronx-cc accepts it; the list predates neuronx-cc",
        ),
    ]
}

COLLECTIVES = (
    "_c10d_functional.all_reduce",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_to_all_single",
)
HOST_READS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique2",
    "aten.item",
)
CLAMPS = ("aten.clamp", "aten.clamp_min", "aten.maximum", "aten.where")
INDEX_MATH = ("aten.floor_divide", "aten.remainder", "aten.div")
BIG_MASK = 1 << 16
LIMIT = 1 << 32


# a finding is stored in bundle.json as it is produced: the record type is the bundle's
Finding = FindingRecord


@dataclass(frozen=True)
class Node:
    index: int
    target: str  # "input", "aten.index_put.default", "output", ...
    name: str  # input name for inputs
    refs: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    text: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_META = re.compile(r"^(\w+)\[([\d, ]*)\]$")


def parse_canonical(text: str) -> list[Node]:
    """The node lines of a canonical graph text (see compile.trace.canonical_text)."""
    nodes = []
    for line in text.splitlines():
        if not line.startswith("%"):
            continue
        head, _, meta = line.rpartition(" : ")
        index_part, _, body = head.partition(" = ")
        m = _META.match(meta.strip())
        dtype, shape = (
            (m.group(1), tuple(int(x) for x in m.group(2).split(",") if x.strip()))
            if m
            else ("", ())
        )
        if body.startswith("input "):
            target, name, refs = "input", body[len("input ") :], ()
        else:
            target = body.split("(", 1)[0]
            name, refs = "", tuple(int(r) for r in re.findall(r"%(\d+)", body.split("(", 1)[-1]))
        nodes.append(Node(int(index_part[1:]), target, name, refs, dtype, shape, line))
    return nodes


@dataclass
class GraphFacts:
    """What the rules read about one graph."""

    name: str
    phase: str
    text: str
    io_alias: tuple[IoAlias, ...]
    flags: tuple[str, ...]
    flag_origins: dict[str, str]
    target: str
    neuron_target: str | None = None
    # Whether the graph runs collectives; derived from the nodes unless given (a manifest alone
    # knows only that tp > 1).
    collectives: bool | None = None
    hlo_text: str | None = None  # neuron: the HLO module neuronx-cc reads (hlo_audit.py)
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = parse_canonical(self.text)
        if self.collectives is None:
            self.collectives = any(n.target.startswith(COLLECTIVES) for n in self.nodes)


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
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.slice", "aten.select",
    "aten.expand", "aten.permute", "aten.unsqueeze", "aten.squeeze", "aten.alias",
    "aten.as_strided", "aten.t.", "aten.transpose",
)  # fmt: skip


def _view_of_input(nodes: list[Node], node: Node) -> bool:
    """Is `node` (through views only) a view of a graph input? Functionalization replays a
    mutated aliased input as an as_strided of its base; an as_strided of a computed value (the
    identity view models/projection.materialized writes) aliases no input."""
    base = nodes[node.refs[0]] if node.refs else None
    while base is not None and base.target.startswith(_VIEWS) and base.refs:
        base = nodes[base.refs[0]]
    return base is not None and base.target == "input"


def _bool_and(g: GraphFacts) -> Iterator[Finding]:
    nodes = g.nodes
    for node in nodes:
        if not node.target.startswith(("aten.bitwise_and", "aten.logical_and", "aten.__and__")):
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
    graph meant (field notes, seed 000 §7)."""
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
    if g.phase == "decode" and g.collectives and (not levels or levels[-1] != "-O3"):
        yield _finding("NK205", "warning", g, levels[-1] if levels else "(default -O)")


HLO_SEVERITY = {"NK301": "error", "NK302": "error", "NK303": "error", "NK304": "error",
                "NK305": "info"}  # fmt: skip


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
        facts = GraphFacts(u.spec.name, u.spec.phase, u.trace.canonical_text, u.trace.io_alias,
                           o.flags, o.flag_origins, m.target, neuron, hlo_text=hlo)  # fmt: skip
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
