"""The backend interface: what `build` asks of a target, in the spirit of vLLM's CompilerInterface.

A backend names its version and cache factors, lowers a traced graph to what its compiler reads
(where it has such a form), compiles the cache misses into artifacts inside the staging directory,
says how `--verify` runs an artifact on this host, and adds its own fields to the bundle record.
`build` holds no target-specific branch: a new target is one file here and one registry entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from neffkit.compile.units import CacheFactors
from neffkit.contract.records import HostRecord, NeuronRecord
from neffkit.models.forms import ProjectionPolicy

if TYPE_CHECKING:
    from neffkit.compile.units import (
        BuildContext,
        Compiled,
        GraphUnit,
        LoweredGraph,
        ModelLayout,
        Runner,
        SpmdRunner,
        Traced,
    )
    from neffkit.manifest import Manifest


class Backend(Protocol):
    name: str
    device: str  # where graphs are traced
    artifact_suffix: str  # ".pt2", ".neff"
    # how graphs write projections and store their weights (models/projection.py)
    projection: ProjectionPolicy

    @property
    def version(self) -> str: ...

    def host_requirements(self) -> HostRecord:
        """What a host must have to run the artifacts (recorded; checked by the loader)."""
        ...

    def check_ready(self, lower_only: bool, dry_run: bool) -> None:
        """Refuse early (before tracing) what this host or this mode cannot build."""
        ...

    def lower(self, traced: Traced, world_size: int) -> LoweredGraph | None:
        """The compiler's input form of a graph (checked for SPMD and cached), or None."""
        ...

    def cache_factors(self, unit: GraphUnit, manifest: Manifest) -> CacheFactors:
        """Factors beyond the graph, options and versions that change this unit's artifact."""
        ...

    def write_inputs(self, stage: Path, units: list[GraphUnit]) -> None:
        """Files the bundle carries besides ir/ (neuron: the HLO modules it compiles from)."""
        ...

    def compile(self, ctx: BuildContext, stage: Path, units: list[GraphUnit]) -> list[Compiled]:
        """Compile the cache misses (in parallel through ctx.run_parallel), in order."""
        ...

    def verify_runner(
        self, layout: ModelLayout, unit: GraphUnit, stage: Path
    ) -> tuple[Runner, str]:
        """How `build --verify` runs this unit's artifact here, and the executor's name."""
        ...

    def spmd_runner(self, unit: GraphUnit, ranks: int) -> tuple[SpmdRunner, str] | None:
        """How `build --verify` runs a tp > 1 unit's artifact as every rank at once here, or
        None where this host cannot (cpu/cuda: it would need a process group per rank)."""
        ...

    def target_record(
        self, manifest: Manifest, lower_only: bool
    ) -> tuple[NeuronRecord | None, str | None]:
        """bundle.json's target section: the chip record and stage, where the target has them."""
        ...
