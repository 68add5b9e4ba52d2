"""Run a bundle's HLO modules on XLA:CPU (through jaxlib): the neuron target's proof off Trainium.

The same `HloModuleProto` neuronx-cc compiles is converted back to StableHLO and compiled by
XLA:CPU; its `input_output_alias` is honoured, so K/V caches are donated and come back as the
aliased outputs, exactly the contract the Neuron runtime follows with the io-alias map.
Used by `neffkit build --verify` and by `neffkit run --executor xla-cpu`. Imports jax lazily and
nothing from neffkit.compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from neffkit.errors import BundleError

if TYPE_CHECKING:
    import torch


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """torch → numpy without a copy, for the dtypes numpy lacks too (bfloat16, float8_e4m3fn as
    ml_dtypes' types, which jax reads)."""
    import torch

    narrow = {
        torch.bfloat16: ("bfloat16", torch.int16),
        torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8),
    }
    if tensor.dtype in narrow:
        import ml_dtypes

        name, bits = narrow[tensor.dtype]
        return tensor.view(bits).numpy().view(getattr(ml_dtypes, name))
    return tensor.numpy()


class XlaCpu:
    """One XLA:CPU client and device: compiles HLO protos, runs them on numpy or device arrays."""

    def __init__(self) -> None:
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
        self._jax = jax
        self._xc = xla_client
        self.backend = jex.backend.get_backend("cpu")
        self.device = self.backend.local_devices()[0]

    def compile(self, proto: bytes) -> Any:
        stablehlo = self._xc._xla.mlir.hlo_to_stablehlo(proto)
        devices = self._xc.DeviceList((self.device,))
        return self.backend.compile_and_load(stablehlo, devices, self._xc.CompileOptions())

    def put(self, array: np.ndarray) -> Any:
        return self._jax.device_put(np.ascontiguousarray(array), self.device)

    @staticmethod
    def run(executable: Any, args: Sequence[Any]) -> list[Any]:
        """Execute; arguments aliased to outputs are donated (unusable afterwards)."""
        return list(executable.execute(list(args)))
