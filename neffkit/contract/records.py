"""The records of bundle.json (format 1): the contract between `neffkit build` and every reader.

Each record is a frozen dataclass that encodes itself (codec.py). Imports no torch and neither
side of the build/serve split: both depend on these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from neffkit.contract import abi
from neffkit.contract.codec import JsonObject, JsonValue, OptionValue, Record, encode  # noqa: F401 (the records' type hints name JsonValue)
from neffkit.contract.fp8 import Fp8Record
from neffkit.contract.kv_groups import KVGroup
from neffkit.contract.lora import LoraRecord
from neffkit.targets import DTYPE_BYTES

FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorRecord(Record):
    """A graph input or output: name, static shape, dtype name (torch's spelling)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class IoAlias(Record):
    """Graph output `output` is written back into input `input` (the KV cache, in place)."""

    input: str
    output: int


@dataclass(frozen=True)
class GraphBuckets(Record):
    """The shapes one graph was built for: rows (sequences), tokens per row, context attended."""

    rows: int
    tokens: int
    context: int


@dataclass(frozen=True)
class VerifyRecord(Record):
    """`build --verify`'s result for one graph, or why it was skipped."""

    OMIT_NONE = True
    ok: bool | None = None
    tokens_equal: bool | None = None
    max_kv_error: float | None = None
    tolerance: float | None = None
    executor: str | None = None
    skipped: str | None = None
    max_logprob_error: float | None = None
    near_ties: int | None = None  # greedy rows that differ only between near-equal logprobs


@dataclass(frozen=True)
class KernelTiming(Record):
    """cpu_kernel auto: a graph's projections timed on the build host (ms for the whole
    graph) with the kernel for weights of 1 MiB or more, in Inductor's form, and with the kernel
    for every weight, and the form it took: "kernel", "inductor" or "kernel-all"
    (compile/autotune.py)."""

    OMIT_NONE = True
    kernel_ms: float
    inductor_ms: float
    chosen: str
    kernel_all_ms: float | None = None


@dataclass(frozen=True)
class CompilerRecord(Record):
    """How neuronx-cc made one NEFF: its argv (paths relative to the bundle), version, log."""

    argv: tuple[str, ...]
    version: str
    log: str


@dataclass(frozen=True)
class ArtifactMetadata(Record):
    """What the compiler says about an artifact: AOTInductor's own metadata (cpu, cuda) or the
    NEFF header as the build read it (neuron; the loader compares the file against it)."""

    aotinductor: dict[str, str] = field(default_factory=dict)
    neff_header: dict[str, int | str] | None = None

    def to_json(self) -> JsonObject:  # stored flat: the AOTInductor keys, or {"neff_header"}
        if self.neff_header is not None:
            return {"neff_header": dict(self.neff_header)}
        return dict(self.aotinductor)

    @classmethod
    def from_json(cls, data: JsonObject) -> ArtifactMetadata:
        if "neff_header" in data:
            return cls(neff_header=data["neff_header"])  # type: ignore[arg-type]
        return cls(aotinductor=dict(data))  # type: ignore[arg-type]


NEURON_GRAPH_FIELDS = ("hlo", "hlo_text", "hlo_sha256", "compiler")


@dataclass(frozen=True)
class GraphRecord(Record):
    """One graph of the bundle. Deterministic (no timings), so identical rebuilds are identical."""

    name: str
    phase: str
    buckets: GraphBuckets
    artifact: str | None  # None in a lowered neuron bundle (no NEFF yet)
    ir: str
    graph_sha256: str
    cache_key: str | None
    options: dict[str, OptionValue]
    option_origins: dict[str, str]
    flags: tuple[str, ...]
    flag_origins: dict[str, str]
    io_alias: tuple[IoAlias, ...]
    inputs: tuple[TensorRecord, ...]
    outputs: tuple[TensorRecord, ...]
    ranks: str | tuple[int, ...]  # "all": one SPMD artifact serves every rank
    artifact_metadata: ArtifactMetadata = ArtifactMetadata()
    verify: VerifyRecord | None = None
    # neuron: the HLO module neuronx-cc compiles, its text for people, and how it was compiled
    hlo: str | None = None
    hlo_text: str | None = None
    hlo_sha256: str | None = None
    compiler: CompilerRecord | None = None
    # how the layers' projections were written for the compiler (models/projection.py):
    # "kernel-rows" (cpu: neffkit's kernel on blocked weights), "blocked-rows" (cpu decode:
    # per-row reductions sharing each blocked weight tile), "blocked-bmm" (cpu prefill: bmm over
    # the blocks), "reduction", "mm", "dot" (HLO); ints: kernel-packed, packed-rows, kernel-int8
    projection: str | None = None
    kernel_timing: KernelTiming | None = None  # cpu_kernel auto's measurement of this graph
    # "kernel": decode attention through neffkit::paged_decode_attention (cpu), which reads only
    # each row's visible keys; None: the graph's own gather, mask and softmax
    attention: str | None = None

    @property
    def stem(self) -> str:
        """File stem of this graph's ir/ and artifact files (per-rank graphs carry their rank)."""
        return Path(self.ir).name.removesuffix(".txt.zst")

    def serves(self, rank: int) -> bool:
        return self.ranks == "all" or rank in self.ranks

    def to_json(self) -> JsonObject:
        data = super().to_json()
        if self.hlo is None:  # only neuron graphs carry the HLO fields
            for key in NEURON_GRAPH_FIELDS:
                del data[key]
        for key in ("kernel_timing", "attention"):  # absent where unused
            if data[key] is None:
                del data[key]
        return data


@dataclass(frozen=True)
class PoolingRecord(Record):
    """An embed bundle's (the manifest's `task: embed`): how its prefill graphs pool each
    sequence's final hidden states (`pooled`, `width` wide) and whether the runtime scales the
    result to unit length."""

    pooling: str  # "last", "mean" or "cls" (abi.POOLED says what a chunk's graph returns)
    normalize: bool
    width: int


@dataclass(frozen=True)
class BucketLists(Record):
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    context: tuple[int, ...]
    prefill_batch: tuple[int, ...] = (1,)  # rows of the prefill graphs (packed prompts)


@dataclass(frozen=True)
class SpeculationRecord(Record):
    """Speculative decoding (the manifest's `speculation`): verify graphs of 1 + num_tokens
    tokens a row up to max_batch rows, drafts from `method`."""

    method: str
    num_tokens: int
    max_batch: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # method "draft": the draft model's bundle, a directory of this one (its own graphs, weights
    # and KV cache; its files are hashed into this bundle's `files` too)
    draft: str = ""


@dataclass(frozen=True)
class LayoutRecord(Record):
    """What the runtime allocates and schedules by: ranks, KV cache shape, buckets."""

    world_size: int
    tp: int
    ep: int
    dtype: str
    num_layers: int
    kv_heads_per_rank: int
    rank_input: bool  # graphs take this rank's index as a tensor (expert parallelism)
    head_dim: int
    block_size: int
    num_blocks: int
    buckets: BucketLists
    max_top_k: int  # candidates of top-k / top-p sampling (requests above it are refused)
    # the cache tensors' dtype: the model dtype, or float8_e4m3fn (the manifest's kv_cache.dtype)
    kv_dtype: str
    # logprobs the graphs return per sampled token
    max_logprobs: int = 0
    prompt_logprobs: bool = False  # prefill graphs return the prompt's own logprobs (echo)
    # the runtime shares full prompt blocks across requests by default (kv_cache.prefix_caching)
    prefix_caching: bool = True
    speculation: SpeculationRecord | None = None
    # "mha": a K and a V tensor per layer; "mla": one latent tensor per layer (DeepSeek), whose
    # head_dim is the per-token width kv_lora_rank + qk_rope_head_dim, with one "head"
    kv_kind: str = "mha"
    # "device": graphs take the aliased `last_tokens` state after the caches (decode reads its
    # tokens there; the host sends `seq_slots`); "host": decode takes `input_ids`
    decode_state: str = "host"
    # the sampling graphs' logit inputs (abi.logit_inputs; 0: none): a grammar's token bitmask
    # (sampling.structured), penalty pairs and logit-bias pairs per row
    bitmask_words: int = 0
    penalty_tokens: int = 0
    bias_tokens: int = 0
    lora: LoraRecord | None = None  # adapter slots after the state (contract/lora.py)
    # the KV groups (contract/kv_groups.py), group 0's pool being num_blocks; empty: every layer
    # in one group of num_blocks (a bundle without sliding-window layers)
    kv_groups: tuple[KVGroup, ...] = ()
    pooling: PoolingRecord | None = None  # an embed bundle: pooled states, nothing sampled

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The KV groups, one full group of num_blocks where the bundle lists none."""
        full = self.buckets.context[-1] // self.block_size
        return self.kv_groups or (
            KVGroup(tuple(range(self.num_layers)), None, self.num_blocks, full),
        )

    @property
    def state_names(self) -> list[str]:
        """The device-resident state tensors' graph input names (after the caches)."""
        return abi.state_names(self.decode_state)

    @property
    def kv_names(self) -> list[str]:
        """The cache tensors' graph input names, in order."""
        return abi.kv_cache_names(self.num_layers, self.kv_kind)

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes on one rank, every layer."""
        return (
            len(self.kv_names) * self.kv_heads_per_rank * self.head_dim * DTYPE_BYTES[self.kv_dtype]
        )


@dataclass(frozen=True)
class WeightsRecord(Record):
    """One rank's pre-cut shard: its file and tensor names in graph-input order."""

    rank: int
    file: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Versions(Record):
    """The tools that made the bundle."""

    neffkit: str
    torch: str  # AOTInductor artifacts run only under the torch that compiled them
    backend: str  # the backend's own version string (AOTInductor, or torch-mlir + jaxlib)


@dataclass(frozen=True)
class HostRecord(Record):
    """What the artifacts need of the host that runs them (none for NEFFs: checked per header)."""

    OMIT_NONE = True
    machine: str | None = None
    cpu_flags: tuple[str, ...] | None = None
    cuda_capability: str | None = None


@dataclass(frozen=True)
class NeuronRecord(Record):
    target: str  # trn1 | trn2 | trn3
    lnc: int


@dataclass(frozen=True)
class FindingRecord(Record):
    """One audit finding: rule id, severity, graph, the node or flag it points at, a fix."""

    rule: str
    severity: str
    graph: str
    at: str  # node ("%12 = aten.index_put...") or flag
    message: str
    fix: str
    waived: bool = False


@dataclass(frozen=True)
class AuditRecord(Record):
    waived: tuple[str, ...] = ()
    findings: tuple[FindingRecord, ...] = ()


@dataclass(frozen=True)
class ModelRecord(Record):
    """The resolved model config, verbatim (provenance), with the fields the runtime reads typed."""

    architecture: str
    num_layers: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    config: JsonObject

    def to_json(self) -> JsonObject:
        return encode(self.config)  # type: ignore[return-value]

    @classmethod
    def from_json(cls, data: JsonObject) -> ModelRecord:
        return super().from_json({**data, "config": data})  # `config`: the whole object


@dataclass(frozen=True)
class ManifestRecord(Record):
    """The resolved manifest, verbatim (provenance), with the fields readers need typed."""

    name: str
    model: str  # the model directory the bundle was built from
    resolved: JsonObject

    def to_json(self) -> JsonObject:
        return encode(self.resolved)  # type: ignore[return-value]

    @classmethod
    def from_json(cls, data: JsonObject) -> ManifestRecord:
        return cls(data["name"], data["model"], dict(data))  # type: ignore[arg-type]


@dataclass(frozen=True)
class BundleRecord(Record):
    """bundle.json: the contract between `neffkit build` and everything that reads a bundle."""

    versions: Versions
    target: str
    host: HostRecord
    manifest: ManifestRecord
    model: ModelRecord
    layout: LayoutRecord
    graphs: tuple[GraphRecord, ...]
    weights: tuple[WeightsRecord, ...]
    tokenizer: str | None
    audit: AuditRecord
    neuron: NeuronRecord | None = None
    stage: str | None = None  # neuron: "lowered" (HLO only) or "compiled" (NEFFs)
    fp8: Fp8Record | None = None  # only bundles with fp8 weights or an fp8 KV cache
    files: dict[str, str] = field(default_factory=dict)  # path → sha256, bundle.json excluded
    format: int = FORMAT_VERSION
    # cpu: kernel libraries the graphs call (neffkit/cpu_kernels.py), loaded before the graphs
    kernels: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def lowered(self) -> bool:
        return self.stage == "lowered"

    def graph(self, name: str) -> GraphRecord | None:
        return next((g for g in self.graphs if g.name == name), None)

    def weights_of(self, rank: int) -> WeightsRecord:
        return next(w for w in self.weights if w.rank == rank)

    def to_json(self) -> JsonObject:
        data = super().to_json()
        if self.neuron is None:  # only neuron bundles carry the chip and stage
            del data["neuron"], data["stage"]
        if self.fp8 is None:
            del data["fp8"]
        return data
