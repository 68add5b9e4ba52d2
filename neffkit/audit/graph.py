"""What the rules read about one graph: its canonical text parsed into nodes, its inputs, io-alias
map and rendered flags, and (neuron) its HLO module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from neffkit.contract.records import IoAlias

if TYPE_CHECKING:
    pass


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
    refs: tuple[int, ...]
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
        node = Node(
            index=int(index_part[1:]),
            target=target,
            name=name,
            refs=refs,
            dtype=dtype,
            shape=shape,
            text=line,
        )
        nodes.append(node)
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
    hlo_text: str | None = None  # neuron: the HLO module neuronx-cc reads (audit/hlo.py)
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = parse_canonical(self.text)
        if self.collectives is None:
            self.collectives = any(n.target.startswith(COLLECTIVES) for n in self.nodes)
