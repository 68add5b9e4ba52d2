"""Run a bundle's HLO modules on XLA:CPU (through jaxlib): the neuron target's proof off Trainium.

The same `HloModuleProto` neuronx-cc compiles is converted back to StableHLO and compiled by
XLA:CPU; its `input_output_alias` is honoured, so K/V caches are donated and come back as the
aliased outputs, exactly the contract the Neuron runtime follows with the io-alias map. A tp > 1
module runs as SPMD over N host devices in one process (jax's `jax_num_cpu_devices`, or XLA's
`--xla_force_host_platform_device_count` when the user sets it): replicas = ranks, each rank's
arguments on its own device, so the module's `all_reduce`s (replica_groups {{0..N-1}}) execute
for real.
Used by `neffkit build --verify` and by `neffkit run --executor xla-cpu`. Imports jax lazily and
nothing from neffkit.compile.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from neffkit.errors import BundleError

if TYPE_CHECKING:
    import torch


ML_DTYPES = ("bfloat16", "float8_e4m3fn")  # dtypes numpy lacks: ml_dtypes' types (jax reads them)


def numpy_dtype(name: str) -> np.dtype:
    """A dtype name (torch's spelling) as numpy's."""
    if name in ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """torch → numpy without a copy, bfloat16 and float8_e4m3fn included."""
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name in ML_DTYPES:  # numpy cannot take these from torch: view the bits
        bits = {2: torch.int16, 1: torch.uint8}[tensor.element_size()]
        return tensor.view(bits).numpy().view(numpy_dtype(name))
    return tensor.numpy()


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
HOST_DEVICES = 8  # asked for once, before the CPU client exists: enough for tp up to 8


def _ask_for_host_devices(jax: Any, count: int) -> None:
    """jax fixes its CPU device count when its CPU client starts: ask before that (unless the
    user's XLA_FLAGS already say how many)."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    if DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", ""):
        return
    jax.config.update("jax_num_cpu_devices", max(count, HOST_DEVICES))


class XlaCpu:
    """One XLA:CPU client: compiles HLO protos, runs them on one device or as SPMD replicas over
    `devices` host devices."""

    def __init__(self, devices: int = 1) -> None:
        try:
            import jax
            import jax.extend as jex
            from jax._src.lib import xla_client
        except ImportError as exc:
            raise BundleError(
                "the XLA:CPU executor needs jax and jaxlib, which are not installed",
                hint="pip install 'neffkit[lower]'",
            ) from exc
        jax.config.update("jax_enable_x64", True)  # int64 metadata stays int64
        _ask_for_host_devices(jax, devices)
        self._jax = jax
        self._xc = xla_client
        self.backend = jex.backend.get_backend("cpu")
        self.devices = self.backend.local_devices()[:devices]
        if len(self.devices) < devices:
            raise BundleError(
                f"XLA:CPU started with {len(self.backend.local_devices())} host device(s) in this "
                f"process; running {devices} ranks needs {devices}",
                hint=f"set XLA_FLAGS={DEVICE_COUNT_FLAG}={devices} before the process starts, "
                "or run the ranks in a fresh process",
            )
        self.device = self.devices[0]
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        # one argument of a replicated run: a rank's array per device, stacked on axis 0
        self._by_rank = NamedSharding(
            Mesh(np.array(self.devices), ("rank",)), PartitionSpec("rank")
        )

    def compile(self, proto: bytes) -> Any:
        """Compile for one device, or as `len(self.devices)` replicas (one per rank)."""
        xc = self._xc
        stablehlo = xc._xla.mlir.hlo_to_stablehlo(proto)
        options = xc.CompileOptions()
        replicas = len(self.devices)
        if replicas > 1:
            options.num_replicas, options.num_partitions = replicas, 1
            assignment = np.arange(replicas).reshape(replicas, 1)
            options.device_assignment = xc.DeviceAssignment.create(assignment)
        return self.backend.compile_and_load(stablehlo, xc.DeviceList(tuple(self.devices)), options)

    def put(self, array: np.ndarray, device: Any = None) -> Any:
        """`array` on `device` (default: the first)."""
        return self._jax.device_put(np.ascontiguousarray(array), device or self.device)

    def put_ranks(self, arrays: Sequence[np.ndarray]) -> Any:
        """One argument of a replicated run: `arrays[r]` on rank r's device."""
        return self.join([self.put(a, d) for a, d in zip(arrays, self.devices, strict=True)])

    def join(self, per_rank: Sequence[Any]) -> Any:
        """Device arrays, one per rank, as one replicated-run argument (no copy)."""
        first = per_rank[0]
        shape = (first.shape[0] * len(per_rank), *first.shape[1:])
        return self._jax.make_array_from_single_device_arrays(shape, self._by_rank, list(per_rank))

    @staticmethod
    def run_ranks(executable: Any, args: Sequence[Any]) -> list[list[Any]]:
        """Execute every replica; per output, the device array of each rank (aliased arguments
        are donated)."""
        return executable.execute_sharded(list(args)).disassemble_into_single_device_arrays()

    @staticmethod
    def run(executable: Any, args: Sequence[Any]) -> list[Any]:
        """Execute; arguments aliased to outputs are donated (unusable afterwards)."""
        return list(executable.execute(list(args)))
