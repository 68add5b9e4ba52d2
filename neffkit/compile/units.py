"""Every value passed between build stages: plan → trace → check → cache → compile → write.

Stages import these; this module imports no stage (a test checks), so the values can be read and
built in any stage without a cycle. A trace worker returns a `TraceResult` (picklable: the
exported program stays in the worker; the compile worker re-traces and checks the sha). The
check stage turns each graph's per-rank results into `GraphUnit`s, one per artifact to build;
later stages fill in a unit's cache key, artifact record and verify result. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffkit.contract.abi import PHASES, GraphKey, Phase, TensorSpec
from neffkit.contract.codec import JsonObject, OptionValue
from neffkit.contract.kv_groups import KVGroup
from neffkit.contract.lora import LoraRecord
from neffkit.contract.records import (
    ArtifactMetadata,
    CompilerRecord,
    IoAlias,
    TensorRecord,
    VerifyRecord,
)
from neffkit.models.forms import PLAIN, ProjectionPolicy, Storage
from neffkit.models.parallel import Parallelism
from neffkit.models.registry import ModelConfig
from neffkit.targets import E4M3FN_MAX

if TYPE_CHECKING:
    import numpy as np

    from neffkit.compile.progress import Progress
    from neffkit.manifest import Manifest


# ------------------------------------------ the plan: which graphs, with which compiler options


# forms within this of each other measured alike: a shared host's noise is larger than that
# difference, so the default form is kept (compile/autotune.py)
NOISE = 0.05


def margin_of(ms: dict[str, float]) -> float:
    """The runner-up's time over the fastest's, less 1: how clear a choice of form is."""
    fastest, runner_up = sorted(ms.values())[:2]
    return runner_up / fastest - 1 if fastest > 0 else 0.0


@dataclass(frozen=True)
class FormTiming:
    """One row count's projections timed here (ms for the whole graph) in each form: the
    kernel for weights of kernel_min_bytes or more (Inductor's form for the smaller), the
    kernel for every weight, and Inductor's form (blocked rows or bmm) for every weight."""

    rows: int
    kernel_ms: float
    inductor_ms: float
    kernel_all_ms: float
    measurements: int = 1  # times this host measured these shapes (a thin margin: again)

    @property
    def forms(self) -> dict[str, float]:
        return {
            "kernel": self.kernel_ms,
            "kernel-all": self.kernel_all_ms,
            "inductor": self.inductor_ms,
        }

    @property
    def margin(self) -> float:
        """How clear the choice is (margin_of its figures; autotune.py measures again below
        THIN)."""
        return round(margin_of(self.forms), 4)

    @property
    def chosen(self) -> str:
        """ "kernel", "kernel-all" or "inductor": the fastest, unless no form is faster than
        another beyond the noise (NOISE): then the default form, the kernel."""
        if self.margin < NOISE:
            return "kernel"
        return min(self.forms, key=self.forms.__getitem__)


@dataclass(frozen=True)
class GraphSpec:
    name: str
    phase: Phase
    rows: int  # sequences per call
    tokens: int  # tokens per sequence (1 for decode)
    context: int  # context bucket: tokens attended at most

    @classmethod
    def of(cls, key: GraphKey) -> GraphSpec:
        return cls(key.name, key.phase, key.rows, key.tokens, key.context)

    @property
    def key(self) -> GraphKey:
        return GraphKey(self.phase, self.rows, self.tokens, self.context)

    @property
    def bucket(self) -> int:
        """The phase's own bucket value: tokens for prefill, batch for decode and verify."""
        return self.tokens if PHASES[self.phase].bucket == "tokens" else self.rows

    def matches(self, match: dict) -> bool:
        """Per-graph rule matching on phase and bucket values or [lo, hi] ranges."""
        values = {"phase": self.phase, "context": self.context, "batch": self.rows}
        if PHASES[self.phase].bucket == "tokens":
            values["tokens"] = self.tokens
        for key, want in match.items():
            have = values.get(key)
            if have is None:
                return False
            if isinstance(want, list):
                if not want[0] <= have <= want[1]:
                    return False
            elif have != want:
                return False
        return True


@dataclass(frozen=True)
class Plan:
    manifest: Manifest
    graphs: tuple[GraphSpec, ...]
    world_size: int


PATH_FLAGS = ("--logfile", "--log-file", "--workdir", "--compile_workdir", "--dump", "--output")


@dataclass(frozen=True)
class ResolvedOptions:
    inductor: dict[str, OptionValue]
    origins: dict[str, str]  # inductor option → origin
    flags: tuple[str, ...]  # rendered compiler argv (neuron)
    flag_origins: dict[str, str]  # rendered flag → origin(s)
    warnings: tuple[str, ...] = field(default=())

    def cache_flags(self) -> tuple[str, ...]:
        """The rendered flags that can change the artifact (path-bearing ones removed)."""
        return tuple(f for f in self.flags if not f.startswith(PATH_FLAGS))


# ---------------------------------------------------------- what a rank's graphs are built from


@dataclass(frozen=True)
class ModelLayout:
    """What a rank's graphs are built from: config, per-rank KV heads, weight specs in order,
    and the manifest's resolved choices the graphs depend on."""

    config: ModelConfig
    dtype: str
    kv_heads: int
    weights: tuple[TensorSpec, ...]
    block_size: int
    num_blocks: int
    max_top_k: int  # candidates of top-k / top-p sampling
    storage: Storage  # how the weight shards store the checkpoint (layout.weight_storage)
    kv_dtype: str  # the KV cache tensors' dtype (the manifest resolved it)
    max_logprobs: int = 5  # top logprobs returned per sampled token
    prompt_logprobs: bool = False  # prefill graphs also return the prompt's own logprobs
    device: str = "cpu"
    par: Parallelism = Parallelism()
    projection: ProjectionPolicy = PLAIN  # the target's projection forms
    # the family's own graph options (DeepSeek: mla_decode), as sorted pairs
    graph_options: tuple[tuple[str, str], ...] = ()
    fp8_max: float = E4M3FN_MAX  # the range fp8 values use on the target (targets.fp8_max)
    decode_state: str = "host"  # "device": decode tokens come from the aliased last_tokens
    # hidden-state widths of the graphs' `hidden_states` output and `previous_hidden` input
    # (speculation.method mtp: the target returns its hidden states, the MTP layer takes them)
    hidden_out: int = 0
    hidden_in: int = 0
    # logit inputs of the sampling graphs (abi.logit_inputs): bitmask words, penalty pairs and
    # logit-bias pairs per row; 0: none
    bitmask_words: int = 0
    penalty_tokens: int = 0
    bias_tokens: int = 0
    # cpu_kernel auto: what the build measured per decode row count (compile/autotune.py)
    kernel_timings: tuple[FormTiming, ...] = ()
    lora: LoraRecord | None = None  # adapter slots (the manifest's `lora:`)
    # KV groups (contract/kv_groups.py); empty: every layer's cache has num_blocks blocks
    kv_groups: tuple[KVGroup, ...] = ()
    pooling: str = ""  # embed bundles: how the graphs pool (abi.GraphShape.pooling)


# --------------------------------------------------------------------------------------- traces


@dataclass
class Traced:
    spec: GraphSpec
    program: Any  # torch.export.ExportedProgram (this module imports no torch)
    canonical_text: str
    graph_sha256: str
    io_alias: tuple[IoAlias, ...]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    sources: list[str]  # per canonical line: the model source line that made the node


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


# ------------------------------------------------------------------------------------ the cache


@dataclass(frozen=True)
class CacheKey:
    """Every factor that changes a compiled artifact, and nothing else."""

    factors: JsonObject

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.factors, sort_keys=True).encode()).hexdigest()


CacheFactors = dict[str, str | int]


# --------------------------------------------------------------------- units: one artifact each


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


# run_parallel(fn, argument tuples, names, progress, keys=None) → results in order
# (compile/jobs/workers.py)
RunParallel = Callable[..., list]


@dataclass(frozen=True)
class BuildContext:
    """What every stage after planning may read: the inputs of the build, never its results."""

    manifest: Manifest
    layout: ModelLayout
    run_parallel: RunParallel
    progress: Progress
    lower_only: bool = False


# --------------------------------------------------------------------------------------- verify

# (inputs) → (user outputs in order, K/V cache tensors by input name)
Runner = Callable[[list[Any]], tuple[list["np.ndarray"], dict[str, "np.ndarray"]]]


# (each rank's inputs) → (rank 0's user outputs, each rank's K/V cache tensors by input name)
SpmdRunner = Callable[[list[list[Any]]], tuple[list["np.ndarray"], list[dict[str, "np.ndarray"]]]]


def job_key(spec: GraphSpec, rank: int | None) -> tuple[str, int]:
    """The pool key of graph `spec` on `rank`: its trace job and its compile job share it, so the
    compile runs in the worker that holds the traced program."""
    return (spec.name, rank or 0)
