"""neuron backend: exported program → HloModuleProto (lowering, any host) → NEFF (neuronx-cc).

Lowering runs where the build runs (CPU CI hosts included) and is proven there on XLA:CPU; the
NEFF step needs neuronx-cc, so a host without it writes a *lowered* bundle (`--lower-only`) that
`neffkit compile` finishes on a Neuron host. Nothing here imports a Neuron package.
"""

from __future__ import annotations

from functools import cached_property
from importlib import metadata
from typing import Any

from neffkit.compile import neuronx_cc
from neffkit.compile.lower import LoweredGraph, lower_program, require_lower_extra


class NeuronBackend:
    name = "neuron"
    device = "cpu"  # where graphs are traced; they run on NeuronCores
    artifact_suffix = ".neff"

    def __init__(self) -> None:
        require_lower_extra()

    @property
    def version(self) -> str:
        """The lowering stack's versions (the compiler's own is recorded per graph)."""
        return f"torch-mlir-{_dist_version('torch-mlir')} jaxlib-{_dist_version('jaxlib')}"

    @cached_property
    def compiler(self) -> str | None:
        return neuronx_cc.find_compiler()

    @cached_property
    def compiler_version(self) -> str:
        return neuronx_cc.compiler_version(self.compiler) if self.compiler else "none"

    def host_requirements(self) -> dict[str, Any]:
        # a NEFF is not tied to the build host; the Trainium generation and lnc are checked from
        # the manifest's `neuron` section and each NEFF's header at load time
        return {}

    def lower(self, traced: Any, world_size: int) -> LoweredGraph:
        return lower_program(
            traced.program, [s.name for s in traced.inputs], traced.io_alias, world_size
        )


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"
