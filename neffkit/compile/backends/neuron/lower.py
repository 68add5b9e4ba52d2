"""torch.export program → StableHLO (torch-mlir) → XLA HloModuleProto (jaxlib), for neuronx-cc.

neuronx-cc's XLA front end reads an `HloModuleProto`; its `input_output_alias` is how it learns
that each K/V cache output is written back into its input buffer. The alias map is attached from
the exported program's signature (the same io-alias map the cpu target records), never by hand.

Two gaps are bridged here (checked with torch-mlir 20261001, jax/jaxlib 0.10.2):
- torch-mlir has no lowering for `_c10d_functional.all_reduce`. Each all-reduce is swapped for an
  `add` of a marker argument before import, and that `add` is rewritten into a
  `stablehlo.all_reduce` (sum over every rank) in the StableHLO text; the markers are then removed
  from the signature.
- the proto's module `id` comes from a process-wide counter, so two conversions of the same module
  differ in that one field. It is dropped (proto3 default 0), which makes `.hlo.pb` files
  byte-identical across ranks, processes and builds and lets its sha256 be the graph's identity.

Needs the `lower` extra (`pip install 'neffkit[lower]'`); imported only for `target: neuron`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

import torch
from torch._ops import OpOverload

from neffkit.compile.units import LoweredGraph
from neffkit.contract.records import IoAlias
from neffkit.errors import BuildError

EXTRA_HINT = "install the lowering extra: pip install 'neffkit[lower]' (torch-mlir, jax, jaxlib)"
_MARKER = "neffkit_all_reduce_marker"
_HLO_MODULE_ID_FIELD = 5  # HloModuleProto.id


def require_lower_extra() -> None:
    """Fail with the extra's name when torch-mlir or jaxlib is missing."""
    missing = []
    for module in ("torch_mlir", "jax", "jaxlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise BuildError(
            f"target 'neuron' lowers through {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed",
            hint=EXTRA_HINT,
        )


def lower_program(
    program: torch.export.ExportedProgram,
    input_names: list[str],
    io_alias: tuple[IoAlias, ...],
    world_size: int,
) -> LoweredGraph:
    """Lower one exported graph.

    `input_names` are the graph contract's input names in order and `io_alias` maps output
    indices to them (both from compile.trace).
    """
    require_lower_extra()
    gm, num_markers = _functional_graph(program)
    stablehlo = _to_stablehlo(gm)
    stablehlo = _rewrite_all_reduces(stablehlo, num_markers, world_size)
    aliases = {input_names.index(a.input): a.output for a in io_alias}
    proto, text = _to_hlo(stablehlo, aliases)
    return LoweredGraph(proto, text, hashlib.sha256(proto).hexdigest())


# ------------------------------------------------------------------ torch side


def _functional_graph(program: torch.export.ExportedProgram) -> tuple[torch.fx.GraphModule, int]:
    """The program's functional graph with every all-reduce swapped for `x + marker_i`.

    Returns the graph and the number of markers (appended after the user inputs).
    """
    from torch.export.graph_signature import InputKind
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    program = program.run_decompositions({**get_decomposition_table(), **unsigned_shifts()})
    if any(s.kind != InputKind.USER_INPUT for s in program.graph_signature.input_specs):
        raise BuildError(
            "the neuron target needs every tensor as a graph input (weights as inputs); "
            "this graph has lifted parameters, buffers or constants"
        )
    gm = program.graph_module
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    reduces = [n for n in graph.nodes if n.target == torch.ops._c10d_functional.all_reduce.default]
    for i, node in enumerate(reduces):
        if node.args[1] != "sum":
            raise BuildError(f"all_reduce with op {node.args[1]!r} cannot be lowered (only sum)")
        with graph.inserting_after(placeholders[-1]):
            marker = graph.placeholder(f"{_MARKER}_{i}")
        marker.meta["val"] = node.args[0].meta["val"]
        placeholders.append(marker)
        with graph.inserting_before(node):
            added = graph.call_function(torch.ops.aten.add.Tensor, (node.args[0], marker))
        added.meta["val"] = node.meta["val"]
        for user in list(node.users):
            if user.target == torch.ops._c10d_functional.wait_tensor.default:
                user.replace_all_uses_with(added)
                graph.erase_node(user)
        node.replace_all_uses_with(added)
        graph.erase_node(node)
    leftovers = {str(n.target) for n in graph.nodes if "_c10d_functional" in str(n.target)}
    if leftovers:
        raise BuildError(f"collectives the neuron lowering does not support: {sorted(leftovers)}")
    graph.lint()
    gm.recompile()
    return gm, len(reduces)


def unsigned_shifts() -> dict[OpOverload, Callable[..., object]]:
    """Shifts of unsigned integers (the packed codes of quantized weights, kernels/intquant.py)
    as integer division and multiplication by a power of two, for `run_decompositions`.

    torch-mlir lowers no scalar shift at all, and lowers a tensor shift right to
    `stablehlo.shift_right_arithmetic`, which XLA runs as a signed shift on uint8 (0xF0 >> 4
    gives 0xFF, not 0x0F). Truncating division by 2^k is the logical shift of an unsigned value
    and lowers to an integer `stablehlo.divide`; a shift left is a product that wraps the same
    way. Shifts of other dtypes stay as they are (NotImplemented: the op itself)."""

    def power(k: torch.Tensor) -> torch.Tensor:
        """2^k as int32 from k's bits, in integers (a float `power` may be inexact on the
        device); k from 8 on shifts every bit of a uint8 out, as 2^8 does."""
        k = k.to(torch.int32).clamp(0, 8)
        bits = [torch.div(k, 1 << i, rounding_mode="trunc") % 2 for i in range(4)]
        return (1 + bits[0]) * (1 + 3 * bits[1]) * (1 + 15 * bits[2]) * (1 + 255 * bits[3])

    def right(x: object, k: torch.Tensor | int) -> object:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
            return NotImplemented
        if isinstance(k, int):
            return torch.div(x, 1 << k, rounding_mode="trunc")
        return torch.div(x.to(torch.int32), power(k), rounding_mode="trunc").to(x.dtype)

    def left(x: object, k: torch.Tensor | int) -> object:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
            return NotImplemented
        if isinstance(k, int):
            return x * (1 << k)
        return (x.to(torch.int32) * power(k)).to(x.dtype)

    aten = torch.ops.aten
    table: dict[OpOverload, Callable[..., object]] = {}
    for fn, packets in (
        (right, ("__rshift__", "bitwise_right_shift")),
        (left, ("__lshift__", "bitwise_left_shift")),
    ):
        for packet in packets:
            for overload in ("Tensor", "Scalar", "Tensor_Scalar"):
                if overload in getattr(aten, packet).overloads():
                    table[getattr(getattr(aten, packet), overload)] = fn
    return table


def _to_stablehlo(gm: torch.fx.GraphModule) -> str:
    from torch_mlir import fx

    try:
        module = fx.stateless_fx_import(gm, output_type="stablehlo", model_name="main")
    except Exception as exc:
        raise BuildError(f"torch-mlir could not lower the graph to StableHLO: {exc}") from exc
    return module.operation.get_asm(enable_debug_info=False)


# ------------------------------------------------------------------ StableHLO text


def _rewrite_all_reduces(text: str, num_markers: int, world_size: int) -> str:
    """`%y = stablehlo.add %x, %marker : T` → `stablehlo.all_reduce` (sum over all ranks)."""
    if num_markers == 0:
        return text
    header = re.search(r"func\.func @main\((.*?)\) ->", text, re.S)
    if header is None:
        raise BuildError("lowered module has no @main function")
    args = re.findall(r"(%arg\d+): (tensor<[^>]*>)", header.group(1))
    markers = args[len(args) - num_markers :]
    groups = ", ".join(str(r) for r in range(world_size))
    for name, ttype in markers:
        elem = ttype[len("tensor<") : -1].split("x")[-1]
        pattern = re.compile(
            rf"^(\s*)(%[\w.]+) = stablehlo\.add (?:(%[\w.]+), {name}|{name}, (%[\w.]+)) : "
            rf"{re.escape(ttype)}$",
            re.M,
        )
        found = pattern.findall(text)
        if len(found) != 1:
            raise BuildError(f"all-reduce marker {name} was not lowered to a single add")
        indent, result, x1, x2 = found[0]
        x = x1 or x2
        body = (
            f'{indent}{result} = "stablehlo.all_reduce"({x}) ({{\n'
            f"{indent}^bb0(%lhs: tensor<{elem}>, %rhs: tensor<{elem}>):\n"
            f"{indent}  %sum = stablehlo.add %lhs, %rhs : tensor<{elem}>\n"
            f"{indent}  stablehlo.return %sum : tensor<{elem}>\n"
            f"{indent}}}) {{replica_groups = dense<[[{groups}]]> : "
            f"tensor<1x{world_size}xi64>}} : ({ttype}) -> {ttype}"
        )
        text = pattern.sub(body.replace("\\", "\\\\"), text)
        text = re.sub(rf",\s*{name}: {re.escape(ttype)}", "", text, count=1)
    return text


def _to_hlo(stablehlo: str, aliases: dict[int, int]) -> tuple[bytes, str]:
    """Parse, attach `tf.aliasing_output` per aliased argument, convert to an HloModuleProto."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import xla_client
    from jaxlib.mlir import ir

    with jax_mlir.make_ir_context():
        module = ir.Module.parse(stablehlo)
        main = next(
            op
            for op in module.body.operations
            if ir.StringAttr(op.attributes["sym_name"]).value == "main"
        )
        num_args = len(main.regions[0].blocks[0].arguments)
        i32 = ir.IntegerType.get_signless(32)
        attrs = [
            ir.DictAttr.get(
                {"tf.aliasing_output": ir.IntegerAttr.get(i32, aliases[i])} if i in aliases else {}
            )
            for i in range(num_args)
        ]
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
        text = module.operation.get_asm(enable_debug_info=False)
    try:
        computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
            text, use_tuple_args=False, return_tuple=True
        )
    except Exception as exc:
        raise BuildError(f"jaxlib could not convert StableHLO to an HLO module: {exc}") from exc
    proto = normalise_module_id(computation.as_serialized_hlo_module_proto())
    return proto, computation.as_hlo_text()


# ------------------------------------------------------------------ protobuf wire format


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def normalise_module_id(proto: bytes) -> bytes:
    """Drop HloModuleProto.id (a process-wide counter) from the top level of the message."""
    out = bytearray()
    pos = 0
    while pos < len(proto):
        start = pos
        tag, pos = _varint(proto, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = _varint(proto, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _varint(proto, pos)
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise BuildError(f"unexpected protobuf wire type {wire} in the HLO module")
        if not (field == _HLO_MODULE_ID_FIELD and wire == 0):
            out += proto[start:pos]
    return bytes(out)
