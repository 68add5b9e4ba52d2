"""The typed values that flow between build stages: trace → check → cache → compile → write.

A trace worker returns a `TraceResult` (picklable: the exported program stays in the worker, the
compile worker re-traces and checks the sha). The check stage turns each graph's per-rank results
into `GraphUnit`s, one per artifact to build; later stages fill in a unit's cache key, artifact
record and verify result. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.bundle import (
    ArtifactMetadata,
    CompilerRecord,
    IoAlias,
    TensorRecord,
    VerifyRecord,
)
from neffkit.compile.flags import ResolvedOptions
from neffkit.compile.plan import GraphSpec

if TYPE_CHECKING:
    from neffkit.compile.cache import CacheKey
    from neffkit.compile.progress import Progress
    from neffkit.compile.trace import ModelLayout
    from neffkit.manifest import Manifest

# run_parallel(fn, argument tuples, names, progress) → results in order (compile/workers.py)
RunParallel = Callable[..., list]


@dataclass(frozen=True)
class LoweredGraph:
    """A graph lowered to the compiler's input (neuron: an XLA HloModuleProto)."""

    proto: bytes  # serialized HloModuleProto, module id normalised
    text: str  # HLO text (for inspect, audits and diffs)
    sha256: str  # of `proto`: the graph's identity on the neuron target


@dataclass(frozen=True)
class TraceResult:
    """One rank's trace of one graph, as the build keeps it."""

    graph_sha256: str
    canonical_text: str
    io_alias: tuple[IoAlias, ...]
    inputs: tuple[TensorRecord, ...]
    outputs: tuple[TensorRecord, ...]
    sources: tuple[str, ...]  # per canonical line: the model source line that made the node
    seconds: float
    lowered: LoweredGraph | None = None  # backends that compile a lowered form (neuron)


@dataclass
class GraphUnit:
    """One artifact to build: a graph for every rank (SPMD) or for one rank."""

    spec: GraphSpec
    options: ResolvedOptions
    trace: TraceResult
    rank: int | None = None  # None: one artifact serves every rank (SPMD)
    key: CacheKey | None = None
    cached: Path | None = None
    miss_reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    metadata: ArtifactMetadata = ArtifactMetadata()
    compiler: CompilerRecord | None = None
    verify: VerifyRecord | None = None

    @property
    def stem(self) -> str:
        """File stem of the artifact and ir: per-rank graphs carry their rank."""
        return self.spec.name if self.rank is None else f"{self.spec.name}.rank{self.rank}"


@dataclass(frozen=True)
class Compiled:
    """What a backend's compile step made of one unit."""

    artifact: Path  # inside the staging directory
    seconds: float
    metadata: ArtifactMetadata
    compiler: CompilerRecord | None = None


@dataclass(frozen=True)
class BuildContext:
    """What every stage after planning may read: the inputs of the build, never its results."""

    manifest: Manifest
    layout: ModelLayout
    run_parallel: RunParallel
    progress: Progress
    lower_only: bool = False
