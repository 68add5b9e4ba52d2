"""Executors: how one bundle graph is called. The engine sees only `run(metadata) → outputs`.

Each executor owns a rank's static inputs (its `rank` tensor where graphs take one, the K/V
caches, the weights) in the form its runtime wants, binds them to every graph once, and keeps the
K/V caches current through the graph's io-alias map:
- `aotinductor` (cpu, cuda): AOTInductor packages mutate the K/V tensors in place.
- `xla-cpu` (neuron bundles, lowered or compiled): the HLO modules on XLA:CPU; aliased K/V
  buffers are donated and replaced by the outputs they alias. The test path for neuron bundles;
  a multi-rank bundle runs as SPMD over one host device per rank, in one process.
- `neuron` (compiled neuron bundles on Trainium): NEFFs through nkipy's `spike` bindings, with
  weights and K/V resident on the device. Tested against a stand-in with spike's signatures,
  never on a NeuronCore; the loader checks every NEFF header first.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from neffkit.contract.bundle import Bundle
from neffkit.contract.records import GraphRecord
from neffkit.errors import BundleError
from neffkit.platform.aoti import load_package
from neffkit.platform.xla_cpu import numpy_dtype, to_numpy

GraphRun = Callable[[list[np.ndarray]], list[np.ndarray]]  # metadata → user outputs
EXECUTORS = ("auto", "aotinductor", "xla-cpu", "neuron")


class Executor(Protocol):
    name: str

    def load(self, bundle: Bundle, graph: GraphRecord, num_meta: int) -> GraphRun: ...

    # a static input was rewritten in place (an adapter slot; one tensor per rank the executor
    # runs): replace any copy of it
    def refresh(self, name: str, values: list[torch.Tensor]) -> None: ...


def choose_executor(bundle: Bundle, requested: str) -> str:
    """The executor for this bundle: `auto` picks the target's own; mismatches are refused."""
    target = bundle.target
    if requested not in EXECUTORS:
        raise BundleError(f"unknown executor {requested!r}; choose from {', '.join(EXECUTORS)}")
    own = "aotinductor" if target in ("cpu", "cuda") else "neuron"
    chosen = own if requested == "auto" else requested
    if target in ("cpu", "cuda") and chosen != "aotinductor":
        raise BundleError(f"{bundle.root}: a {target} bundle runs with the aotinductor executor")
    if target == "neuron" and chosen == "aotinductor":
        raise BundleError(f"{bundle.root}: a neuron bundle has no AOTInductor packages")
    if target == "neuron" and chosen == "neuron" and bundle.record.lowered:
        raise BundleError(
            f"{bundle.root}: this neuron bundle is lowered only (HLO modules, no NEFFs)",
            hint="finish it with `neffkit compile BUNDLE` on a Neuron host, or run its HLO "
            "on this host with `--executor xla-cpu`",
        )
    return chosen


def _check_static_order(graph: GraphRecord, num_meta: int, names: list[str]) -> None:
    expected = [i.name for i in graph.inputs[num_meta:]]
    if expected != names:
        raise BundleError(f"graph {graph.name}: its inputs do not match the bundle's weights")


class AotiExecutor:
    name = "aotinductor"

    def __init__(self, statics: list[torch.Tensor], names: list[str], device: str) -> None:
        self.statics, self.names, self.device = statics, names, device

    def load(self, bundle: Bundle, graph: GraphRecord, num_meta: int) -> GraphRun:
        _check_static_order(graph, num_meta, self.names)
        device_index = 0 if self.device == "cuda" else -1
        package = str(bundle.path(graph.artifact or ""))
        runner = load_package(package, device_index)
        statics, device = self.statics, self.device
        bound: list[Any] = [(), []]  # (metadata arrays, full input list) of the previous call

        def run(meta: list[np.ndarray]) -> list[np.ndarray]:
            # The engine passes the same preallocated arrays every decode step; on cpu their
            # torch views share memory, so the input list is built once, not per step.
            reuse = device == "cpu" and len(meta) == len(bound[0])
            if not (reuse and all(a is b for a, b in zip(meta, bound[0], strict=True))):
                bound[0] = list(meta)
                bound[1] = [torch.from_numpy(m).to(device) for m in meta] + statics
            return [out.cpu().numpy() for out in runner.run(bound[1])]

        return run

    def refresh(self, name: str, values: list[torch.Tensor]) -> None:
        """Nothing: the graphs read the statics themselves, which were written in place."""


class XlaCpuExecutor:
    name = "xla-cpu"

    def __init__(self, statics: list[torch.Tensor], names: list[str]) -> None:
        from neffkit.platform.xla_cpu import XlaCpu

        self.xla = XlaCpu()
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        self.arrays = [self.xla.put(to_numpy(t)) for t in statics]  # device-resident state

    def load(self, bundle: Bundle, graph: GraphRecord, num_meta: int) -> GraphRun:
        _check_static_order(graph, num_meta, self.names)
        executable = self.xla.compile(bundle.path(graph.hlo or "").read_bytes())
        aliases = [(self.index[a.input], a.output) for a in graph.io_alias]
        xla, arrays, user = self.xla, self.arrays, len(graph.outputs)

        def run(meta: list[np.ndarray]) -> list[np.ndarray]:
            outs = xla.run(executable, [xla.put(m) for m in meta] + arrays)
            for static_index, output_index in aliases:  # donated inputs → their new values
                arrays[static_index] = outs[output_index]
            return [np.asarray(o) for o in outs[-user:]]  # the user outputs follow the aliases

        return run

    def refresh(self, name: str, values: list[torch.Tensor]) -> None:
        self.arrays[self.index[name]] = self.xla.put(to_numpy(values[0]))


class XlaCpuSpmdExecutor:
    """A multi-rank bundle's HLO as SPMD over one XLA:CPU host device per rank, in one process:
    each rank's statics (rank input, K/V caches, weight shard) stay on its device, the host sends
    the metadata to every rank and reads rank 0's outputs (every rank samples the same tokens)."""

    name = "xla-cpu"

    def __init__(self, statics_by_rank: list[list[torch.Tensor]], names: list[str]) -> None:
        from neffkit.platform.xla_cpu import XlaCpu

        self.ranks = len(statics_by_rank)
        self.xla = XlaCpu(devices=self.ranks)
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        self.arrays = [
            self.xla.put_ranks([to_numpy(statics[i]) for statics in statics_by_rank])
            for i in range(len(names))
        ]

    def load(self, bundle: Bundle, graph: GraphRecord, num_meta: int) -> GraphRun:
        _check_static_order(graph, num_meta, self.names)
        executable = self.xla.compile(bundle.path(graph.hlo or "").read_bytes())
        aliases = [(self.index[a.input], a.output) for a in graph.io_alias]
        xla, arrays, user, ranks = self.xla, self.arrays, len(graph.outputs), self.ranks

        def run(meta: list[np.ndarray]) -> list[np.ndarray]:
            # copies: XLA:CPU may read a host array in place, and the other ranks can still be
            # running when rank 0's outputs are back, while the engine refills its buffers
            args = [xla.put_ranks([np.array(m)] * ranks) for m in meta] + arrays
            outs = xla.run_ranks(executable, args)
            for static_index, output_index in aliases:  # donated inputs → their new values
                arrays[static_index] = xla.join(outs[output_index])
            return [np.asarray(o[0]) for o in outs[-user:]]

        return run

    def refresh(self, name: str, values: list[torch.Tensor]) -> None:
        self.arrays[self.index[name]] = self.xla.put_ranks([to_numpy(v) for v in values])


class NeuronExecutor:
    """NEFFs on a NeuronCore through nkipy's `spike` bindings over libnrt, written against
    aws-neuron/nkipy's spike (`SpikeModel.load_from_neff(path, name, core_id, cc_enabled,
    rank_id, world_size)`, `model(inputs={name: SpikeTensor}, outputs={name: SpikeTensor})`,
    `SpikeTensor.from_numpy / write_from_numpy / numpy`).

    Weights, K/V caches and the decode state (`last_tokens`) are uploaded once and stay
    resident; each aliased output is bound to its input's device tensor, so they are updated in
    place; a graph's metadata tensors are allocated once and rewritten when their values change;
    only the user outputs (sampled tokens and their logprobs) are read back. The NEFF's tensors
    are matched to the graph's by position: the number its names end in (`input5` is HLO
    parameter 5, `output2` result 2), in the HLO parameter order recorded at lowering.
    Collectives get this process's rank and the world size at load. Verified against a stand-in
    with spike's signatures (tests/tools/spike), never on a NeuronCore.
    """

    name = "neuron"

    def __init__(
        self, statics: list[torch.Tensor], names: list[str], rank: int, world_size: int, lnc: int
    ) -> None:
        try:
            import spike  # the Neuron runtime's Python bindings (Neuron DLAMI / nkipy)
        except ImportError as exc:
            raise BundleError(
                "the neuron executor needs the Neuron runtime's Python bindings (`spike`), "
                "which this host does not have",
                hint="run on a Trainium host with the Neuron SDK, or run the bundle's HLO here "
                "with `--executor xla-cpu`",
            ) from exc
        self.spike, self.rank, self.world_size, self.lnc = spike, rank, world_size, lnc
        self.names = names
        # uploaded once: every graph binds these same device tensors
        self.resident = {
            n: spike.SpikeTensor.from_numpy(to_numpy(t), n, core_id=0)
            for n, t in zip(names, statics, strict=True)
        }

    def load(self, bundle: Bundle, graph: GraphRecord, num_meta: int) -> GraphRun:
        _check_static_order(graph, num_meta, self.names)
        spike, path = self.spike, bundle.path(graph.artifact or "")
        model = spike.SpikeModel.load_from_neff(
            str(path),
            name=graph.name,
            core_id=0,
            cc_enabled=self.world_size > 1,
            rank_id=self.rank,
            world_size=self.world_size,
        )
        aliased = len(graph.io_alias)
        in_names = by_position(model.input_tensors_info, "input", len(graph.inputs), path)
        out_names = by_position(
            model.output_tensors_info, "output", aliased + len(graph.outputs), path
        )
        inputs: dict[str, Any] = {}
        meta: list[Any] = []
        for i, spec in enumerate(graph.inputs):
            if i < num_meta:  # allocated once, rewritten every call
                tensor = spike.SpikeTensor.from_numpy(
                    np.zeros(spec.shape, numpy_dtype(spec.dtype)), in_names[i], core_id=0
                )
                meta.append(tensor)
            else:
                tensor = self.resident[spec.name]
            inputs[in_names[i]] = tensor
        outputs = {out_names[a.output]: self.resident[a.input] for a in graph.io_alias}
        user = []
        for j, spec in enumerate(graph.outputs):
            name = out_names[aliased + j]
            tensor = spike.SpikeTensor.from_numpy(
                np.zeros(spec.shape, numpy_dtype(spec.dtype)), name, core_id=0
            )
            outputs[name] = tensor
            user.append(tensor)

        sent: list[np.ndarray | None] = [None] * len(meta)  # what each device tensor holds

        def run(values: list[np.ndarray]) -> list[np.ndarray]:
            # only what changed since this graph's last call goes to the device: in steady
            # decode the block tables, sampling values and (device state) seq_slots stay
            for i, (tensor, value) in enumerate(zip(meta, values, strict=True)):
                held = sent[i]
                if held is None or not np.array_equal(held, value):
                    tensor.write_from_numpy(value)
                    sent[i] = value.copy()
            model(inputs=inputs, outputs=outputs)
            return [tensor.numpy() for tensor in user]

        return run

    def refresh(self, name: str, values: list[torch.Tensor]) -> None:
        self.resident[name].write_from_numpy(to_numpy(values[0]))


def by_position(tensors: Any, kind: str, expected: int, neff: Path) -> list[str]:
    """A NEFF's tensor names in HLO order: sorted by the number each ends in, which must run
    0..expected-1 (anything else is refused with the names, not guessed)."""
    numbered = {}
    for name in tensors:
        m = re.search(r"(\d+)$", name)
        if m:
            numbered[int(m.group(1))] = name
    if sorted(numbered) != list(range(expected)) or len(numbered) != len(tensors):
        raise BundleError(
            f"{neff}: its {kind} tensors {sorted(tensors)} do not number 0..{expected - 1}, "
            f"the graph's {expected} {kind}s in HLO order",
            hint="recompile the bundle's HLO with `neffkit compile`",
        )
    return [numbered[i] for i in range(expected)]


def check_neff(bundle: Bundle, graph: GraphRecord, lnc: int | None) -> None:
    """Refuse a NEFF whose header differs from what the bundle recorded, or from this runtime."""
    from neffkit.contract.neff import NeffError, compatibility_problems, read_header

    path: Path = bundle.path(graph.artifact or "")
    try:
        header = read_header(path)
    except NeffError as exc:
        raise BundleError(str(exc), hint="rebuild or recompile the bundle") from None
    recorded = graph.artifact_metadata.neff_header or {}
    problems = compatibility_problems(header, recorded, lnc)
    if problems:
        raise BundleError(
            f"{path}: this NEFF does not fit the bundle: {'; '.join(problems)}",
            hint="recompile with `neffkit compile`, or set the runtime's lnc to the bundle's",
        )
