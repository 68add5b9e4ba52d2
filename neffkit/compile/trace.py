"""GraphSpec → torch.export ExportedProgram, its canonical text, and the io-alias map.

The io-alias map is read from the exported program's signature after `run_decompositions({})`
(USER_INPUT_MUTATION outputs), never written by hand. The canonical text names nodes by position and
carries no file paths or stack traces, so it is identical across ranks, processes and machines when
the graphs are; its sha256 is the graph's identity (SPMD check, cache key, bundle diff).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from neffkit.compile.layout import graph_inputs, uses_kernel
from neffkit.compile.units import GraphSpec, LoweredGraph, ModelLayout, Traced, TraceResult
from neffkit.contract import abi
from neffkit.contract.abi import TensorSpec, graph_outputs
from neffkit.contract.records import IoAlias, TensorRecord
from neffkit.errors import BuildError
from neffkit.models.registry import build_graph, graph_class

if TYPE_CHECKING:  # the graph module's type, through the registry (never a family module)
    from neffkit.models.registry import DecoderGraph


def ensure_fake_process_group(rank: int, world_size: int) -> None:
    """Trace rank `rank` of `world_size` under torch's fake process group (no peers, no traffic).

    The graph then names the default group, which a real gloo/nccl group resolves at run time, so
    one artifact serves every rank. `fake_pg` lives in torch.testing._internal: the one private
    import neffkit needs (checked on torch 2.9-2.13).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) == (rank, world_size):
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def release_fake_process_group() -> None:
    """Destroy the fake process group tracing set up in this process, if it is the one up: a
    build leaves no process group behind (a later `save_pretrained` or real group sees none)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


def example_inputs(specs: list[TensorSpec], device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Placeholder tensors of the right shapes; export specialises on shapes, never on values."""
    return tuple(torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in specs)


def _anchor_model_source(layout: ModelLayout) -> None:
    """Make node stack traces reach into neffkit's model and kernel functions.

    Non-strict export keeps only frames of functions named `forward`, plus registered anchors,
    so without this a node's source is the top-level call in forward, not the line that made it.
    `_register_stack_trace_anchor` is private (torch.fx.proxy, checked on torch 2.13); on
    versions without it, sources stay at forward-level, which is still correct, only coarser.
    """
    import inspect
    import sys

    from neffkit.kernels import attention, kv, norm, rope, sampling
    from neffkit.models import experts

    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if register is None:
        return
    graph = graph_class(layout.config)
    family = sys.modules[graph.__module__]  # its module-level helpers too
    for module in (attention, kv, norm, rope, sampling, experts, family):
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            register(fn)
    for _, fn in inspect.getmembers(graph, inspect.isfunction):
        register(fn)


def decoder_module(layout: ModelLayout, spec: GraphSpec) -> tuple[DecoderGraph, list[TensorSpec]]:
    """The eager module of one graph and its flat input specs (what is traced, and the oracle
    `build --verify` compares artifacts against)."""
    shape, specs = graph_inputs(layout, spec)
    adapters = layout.lora.names() if layout.lora else []  # taken with the weights, before them
    module = build_graph(
        layout.config,
        shape,
        [*adapters, *(w.name for w in layout.weights)],
        layout.max_top_k,
        layout.par,
        layout.projection,
        layout.fp8_max,
        dict(layout.graph_options),
    )
    return module, specs


def ensure_kernels() -> None:
    """neffkit's CPU kernel library, built (once) and loaded in this process, for tracing and
    for running what calls it (`build --verify`)."""
    from neffkit.platform import cpu_kernels

    try:
        cpu_kernels.ensure_for_tracing()
    except cpu_kernels.KernelBuildError as exc:
        raise BuildError(
            f"compiler.cpu_kernel: {exc}", hint="install g++, or set compiler.cpu_kernel: off"
        ) from None


def trace_graph(layout: ModelLayout, spec: GraphSpec, rank: int = 0) -> Traced:
    """Export one graph as rank `rank` sees it (tp > 1: under the fake process group)."""
    if layout.par.tp > 1:
        ensure_fake_process_group(rank, layout.par.tp)
    if uses_kernel(layout):
        ensure_kernels()
    _anchor_model_source(layout)
    module, specs = decoder_module(layout, spec)
    try:
        with torch.no_grad():
            program = torch.export.export(
                module, example_inputs(specs, layout.device), strict=False
            )
        program = program.run_decompositions({})
    except Exception as exc:  # export failures are build failures with the graph named
        raise BuildError(f"{spec.name}: torch.export failed: {exc}") from exc
    io_alias = io_alias_map(program, [s.name for s in specs])
    text = canonical_text(program, [s.name for s in specs])
    outputs = user_outputs(program, graph_outputs(module.shape))
    digest = hashlib.sha256(text.encode()).hexdigest()
    sources = [node_source(n) for n in program.graph.nodes]
    return Traced(
        spec=spec,
        program=program,
        canonical_text=text,
        graph_sha256=digest,
        io_alias=io_alias,
        inputs=specs,
        outputs=outputs,
        sources=sources,
    )


def user_outputs(program: ExportedProgram, expected: list[TensorSpec]) -> list[TensorSpec]:
    """The program's user outputs, named by the graph contract; a mismatch is a model bug."""
    node = next(n for n in program.graph.nodes if n.op == "output")
    kinds = [s.kind for s in program.graph_signature.output_specs]
    values = [
        v.meta["val"]
        for v, k in zip(node.args[0], kinds, strict=True)
        if k == OutputKind.USER_OUTPUT
    ]
    got = [
        TensorSpec(e.name, tuple(v.shape), str(v.dtype).split(".")[-1])
        for e, v in zip(expected, values, strict=False)
    ]
    if got != expected:
        raise BuildError(f"graph outputs {got} differ from the contract's {expected}")
    return got


def trace_result(traced: Traced, seconds: float, lowered: LoweredGraph | None) -> TraceResult:
    """What the build keeps of a trace (the program itself stays in the worker)."""
    return TraceResult(
        graph_sha256=traced.graph_sha256,
        canonical_text=traced.canonical_text,
        io_alias=traced.io_alias,
        inputs=tuple(tensor_record(s) for s in traced.inputs),
        outputs=tuple(tensor_record(s) for s in traced.outputs),
        sources=tuple(traced.sources),
        seconds=seconds,
        lowered=lowered,
    )


def tensor_record(spec: TensorSpec) -> TensorRecord:
    return TensorRecord(spec.name, tuple(spec.shape), spec.dtype)


def node_source(node: torch.fx.Node) -> str:
    """`file.py:123: code` of the innermost frame that created the node ("" for inputs)."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip()]
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].startswith("File "):
            code = frames[i + 1] if i + 1 < len(frames) else ""
            where = frames[i].split('"')
            file = where[1] if len(where) > 1 else "?"
            line = frames[i].split(", line ")[-1].split(",")[0]
            return f"{file}:{line}: {code}"
    return ""


def _user_input_names(program: ExportedProgram) -> list[str]:
    return [
        s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT
    ]


def io_alias_map(program: ExportedProgram, contract_names: list[str]) -> tuple[IoAlias, ...]:
    """Which program output is written back to which input: (IoAlias("k_cache.3", 4), ...)

    Read from the signature's USER_INPUT_MUTATION specs, so it can never drift from the graph.
    """
    placeholder_to_name = dict(zip(_user_input_names(program), contract_names, strict=True))
    out = []
    for index, spec in enumerate(program.graph_signature.output_specs):
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            out.append(IoAlias(placeholder_to_name[spec.target], index))
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise BuildError(f"unexpected output kind {spec.kind} in exported graph")
    written = {a.input for a in out}
    expected = {name for name in contract_names if abi.is_aliased(name)}
    if written != expected:  # a state input left unwritten, or another input written in place
        raise BuildError(
            f"the graph updates {sorted(written)} in place; the ABI says {sorted(expected)}"
        )
    return tuple(out)


def _format_arg(arg: Any, names: dict[torch.fx.Node, str]) -> str:
    if isinstance(arg, torch.fx.Node):
        return names[arg]
    if isinstance(arg, list | tuple):
        inner = ", ".join(_format_arg(a, names) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k}: {_format_arg(v, names)}" for k, v in arg.items()) + "}"
    return repr(arg) if not isinstance(arg, torch.dtype | torch.device) else str(arg)


def _format_meta(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).split('.')[-1]}{list(val.shape)}"
    if isinstance(val, list | tuple):
        return (
            "("
            + ", ".join(
                f"{str(v.dtype).split('.')[-1]}{list(v.shape)}"
                for v in val
                if isinstance(v, torch.Tensor)
            )
            + ")"
        )
    return ""


def _lifted_label(program: ExportedProgram, target: str) -> str:
    """Constants lifted out of the graph are identified by the hash of their values."""
    value = program.constants.get(target, program.state_dict.get(target))
    if not isinstance(value, torch.Tensor):
        return f"const {target}"
    data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return f"const sha256={hashlib.sha256(data).hexdigest()[:16]}"


def canonical_text(program: ExportedProgram, contract_names: list[str]) -> str:
    """One line per node, names by position; placeholders carry their contract names."""
    contract = dict(zip(_user_input_names(program), contract_names, strict=True))
    lifted = {
        s.arg.name: s.target
        for s in program.graph_signature.input_specs
        if s.kind != InputKind.USER_INPUT
    }
    names: dict[torch.fx.Node, str] = {}
    lines = []
    for i, node in enumerate(program.graph.nodes):
        names[node] = f"%{i}"
        if node.op == "placeholder":
            label = contract.get(node.name) or _lifted_label(program, lifted[node.name])
            lines.append(f"%{i} = input {label} : {_format_meta(node)}")
            continue
        target = str(node.target) if node.op != "output" else "output"
        args = _format_arg(node.args, names)
        kwargs = _format_arg(node.kwargs, names) if node.kwargs else ""
        lines.append(
            f"%{i} = {target}{args}{' ' + kwargs if kwargs else ''} : {_format_meta(node)}"
        )
    signature = [
        f"out {s.kind.name} {contract.get(s.target, '') if s.target else ''}".rstrip()
        for s in program.graph_signature.output_specs
    ]
    return "\n".join(lines + signature) + "\n"
