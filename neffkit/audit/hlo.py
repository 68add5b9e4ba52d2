"""Hazard rules on the HLO module neuronx-cc reads (ir/G.hlo.txt.zst), not on the torch graph.

The torch-level rules (audit.py) guard neffkit's own code against regressions; these read what the
compiler will actually see after torch-mlir and jaxlib, where a harmless torch op can turn into
something Trainium rejects (a floor division became f64 arithmetic in an ep=2 MoE graph). Pure
Python: the module is parsed from its text form.

Rules (ids in targets.AUDIT_RULE_IDS, registered in audit.RULES):
- NK301 f64 (or c128) values anywhere: Trainium has no 64-bit floating point.
- NK302 a collective whose operand is an entry parameter (NCC_INLA001, at the HLO level).
- NK303 a gather or scatter whose indices come from a parameter without a clamp on the way
  (an out-of-range index is an out-of-bounds DMA on Neuron: the -1 slot and out-of-vocabulary
  token hazards).
- NK304 a parameter, or any instruction's value, of 2**32 elements or more (offsets truncate).
- NK305 an opcode missing from the documented list of XLA operators
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/release-notes/archive/neuron-cc/neuron-cc-ops/neuron-cc-ops-xla.html,
  plus those neuronx-cc's release notes add): informational, since the list predates
  neuronx-cc and the compiler accepts more than it names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
CLAMPING = ("clamp", "maximum", "minimum", "select")
LIMIT = 1 << 32

# The documented XLA operators ("Supported operators [XLA]", the page above) in HLO's opcode
# spelling, plus the opcodes neuronx-cc's release notes add (SelectAndScatter 2.4.0.21; Atan2,
# AfterAll, Map: torch-neuronx 1.13.0.1.6.1). `parameter` and `ROOT` plumbing are implied.
DOCUMENTED_OPCODES = frozenset(
    {
        "abs",
        "add",
        "all-gather",
        "all-reduce",
        "atan2",
        "batch-norm-grad",
        "batch-norm-inference",
        "batch-norm-training",
        "broadcast",
        "ceil",
        "clamp",
        "compare",
        "concatenate",
        "constant",
        "convert",
        "cosine",
        "custom-call",
        "divide",
        "dot",
        "dynamic-update-slice",
        "exponential",
        "floor",
        "gather",
        "get-tuple-element",
        "iota",
        "log",
        "and",
        "not",
        "maximum",
        "minimum",
        "multiply",
        "negate",
        "pad",
        "power",
        "reduce",
        "reshape",
        "rng-bit-generator",
        "rng",
        "rsqrt",
        "scatter",
        "select",
        "shift-right-logical",
        "sign",
        "sine",
        "slice",
        "sqrt",
        "subtract",
        "tanh",
        "transpose",
        "tuple",
        "select-and-scatter",
        "after-all",
        "map",
        "parameter",
    }
)


@dataclass(frozen=True)
class Instruction:
    name: str
    dtype: str  # "f32", "s64", ... ("tuple" for tuple-typed values)
    shape: tuple[int, ...]
    opcode: str
    operands: tuple[str, ...]
    text: str
    entry: bool  # in the ENTRY computation

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_TYPE = re.compile(r"^(\w+)\[([\d,]*)\]")


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def parse_hlo(text: str) -> list[Instruction]:
    """The instructions of an HLO module's text form, each knowing whether it is in ENTRY."""
    out, entry = [], False
    shape: tuple[int, ...]
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith("{") and " = " not in line:  # a computation's header
            entry = line.startswith("ENTRY")
            continue
        if " = " not in line or line.startswith(("HloModule", "}")):
            continue
        name, _, rest = line.removeprefix("ROOT ").partition(" = ")
        if rest.startswith("("):  # a tuple type
            end = _balanced(rest, 0)
            dtype, shape, rest = "tuple", (), rest[end:].lstrip()
        else:
            type_text, _, rest = rest.partition(" ")
            m = _TYPE.match(type_text)
            dtype = m.group(1) if m else type_text
            shape = tuple(int(d) for d in m.group(2).split(",") if d) if m else ()
        opcode, paren, _ = rest.partition("(")
        if not paren:
            continue
        args = rest[len(opcode) : _balanced(rest, len(opcode))]
        operands = tuple(re.findall(r"[\w.\-]+", args)) if opcode != "constant" else ()
        inst = Instruction(
            name=name,
            dtype=dtype,
            shape=shape,
            opcode=opcode,
            operands=operands,
            text=line,
            entry=entry,
        )
        out.append(inst)
    return out


@dataclass(frozen=True)
class HloHazard:
    rule: str
    at: str  # the instruction's text
    detail: str


_TUPLE_INDEX = re.compile(r"index=(\d+)")


def _sources(by_name: dict[str, Instruction], inst: Instruction) -> tuple[str, ...]:
    """What an instruction's value is computed from. One element of a sort's or a variadic
    reduce's tuple comes from that element's own operand (and init): an argmax's or top-k's
    index comes from its iota, not from the values compared."""
    if inst.opcode == "get-tuple-element" and inst.operands:
        tuple_op = by_name.get(inst.operands[0])
        m = _TUPLE_INDEX.search(inst.text)
        if tuple_op is not None and m and tuple_op.opcode in ("sort", "reduce"):
            k, ops = int(m.group(1)), tuple_op.operands
            if tuple_op.opcode == "sort":
                return ops[k : k + 1]
            n = len(ops) // 2  # reduce(inputs..., inits...)
            return (ops[k], ops[n + k]) if k < n else ops
    return inst.operands


def _reaches_parameter(by_name: dict[str, Instruction], start: str) -> bool:
    """Does `start` depend on an entry parameter through no clamping instruction?"""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        inst = by_name[name]
        if inst.opcode == "parameter":
            return inst.entry
        if inst.opcode in CLAMPING:
            continue
        todo.extend(_sources(by_name, inst))
    return False


def hlo_hazards(text: str) -> Iterator[HloHazard]:
    """Every hazard in one module (NK301 and NK305 once each, with a count or the opcodes)."""
    instructions = parse_hlo(text)
    by_name = {i.name: i for i in instructions if i.entry}
    unlisted: dict[str, Instruction] = {}
    wide = [i for i in instructions if i.dtype in ("f64", "c128")]
    if wide:  # once per module: one float64 op usually drags a chain of them
        yield HloHazard("NK301", wide[0].text, f"{len(wide)} f64 value(s), first {wide[0].name}")
    for inst in instructions:
        if inst.entry and inst.opcode in COLLECTIVES:
            for operand in inst.operands:
                src = by_name.get(operand)
                if src is not None and src.opcode == "parameter":
                    yield HloHazard("NK302", inst.text, f"{inst.opcode} reads {operand}")
        if inst.entry and inst.opcode in ("gather", "scatter") and len(inst.operands) > 1:
            if _reaches_parameter(by_name, inst.operands[1]):
                yield HloHazard("NK303", inst.text, f"{inst.opcode} indices {inst.operands[1]}")
        if inst.numel >= LIMIT:
            yield HloHazard("NK304", inst.text, f"{inst.name}: {inst.numel} elements")
        if inst.opcode not in DOCUMENTED_OPCODES and inst.opcode not in unlisted:
            unlisted[inst.opcode] = inst
    if unlisted:
        first = next(iter(unlisted.values()))
        yield HloHazard("NK305", first.text, ", ".join(sorted(unlisted)))
