"""The bundle on disk (format 1): write and read `bundle.json`, hash and verify every file.

A bundle is a directory usable in place:
  bundle.json   format, versions, target, host requirements, resolved manifest, model config,
                layout, graphs, weights, files{path: sha256}
  graphs/       compiled artifacts, one per graph
  ir/           canonical graph text per graph, zstd-compressed
  weights/      rank{r}.safetensors, pre-sharded
  tokenizer/    copied from the model directory when present

Imports neither neffkit.compile nor neffkit.runtime (nor torch): both sides depend on this contract.
A compiled artifact is executable code; never load a bundle from a source you do not trust.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import UnionType
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

import zstandard

from neffkit.errors import BundleError
from neffkit.targets import DTYPE_BYTES

FORMAT_VERSION = 1
BUNDLE_JSON = "bundle.json"
PACK_SUFFIX = ".tar.zst"  # a bundle as one file (bundle_pack.py)


def is_pack(path: Path) -> bool:
    """A packed bundle (BUNDLE.tar.zst), which read_bundle extracts, rather than a directory."""
    return path.is_file() and path.name.endswith(PACK_SUFFIX)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_zst_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # level and no threads: the same text always gives the same bytes
    path.write_bytes(zstandard.ZstdCompressor(level=10).compress(text.encode()))


def read_zst_text(path: Path) -> str:
    return zstandard.ZstdDecompressor().decompress(path.read_bytes()).decode()


def list_files(root: Path) -> list[str]:
    """Every file below `root` except bundle.json, as sorted POSIX relative paths."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != BUNDLE_JSON
    )


# ---------------------------------------------------------------- the records

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]
OptionValue = bool | int | float | str


def _encode(value: object) -> JsonValue:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value  # type: ignore[return-value]


def _decode(hint: object, value: JsonValue) -> object:
    """A JSON value as the field's declared type: records, tuples of them, unions with None."""
    if value is None:
        return None
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, Record) and isinstance(value, dict):
                return arg.from_json(value)
            if get_origin(arg) is tuple and isinstance(value, list):
                return _decode(arg, value)
        return value
    if origin is tuple and isinstance(value, list):
        return tuple(_decode(args[0], v) for v in value)
    if isinstance(hint, type) and issubclass(hint, Record) and isinstance(value, dict):
        return hint.from_json(value)
    return dict(value) if isinstance(value, dict) else value


R = TypeVar("R", bound="Record")


class Record:
    """A frozen dataclass of bundle.json that (de)serialises itself field by field, using its
    type hints to rebuild nested records and tuples. `OMIT_NONE` drops unset fields."""

    OMIT_NONE: ClassVar[bool] = False

    def to_json(self) -> JsonObject:
        data = {f.name: _encode(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]
        return {k: v for k, v in data.items() if v is not None} if self.OMIT_NONE else data

    @classmethod
    def from_json(cls: type[R], data: JsonObject) -> R:
        hints, known = _field_hints(cls)
        return cls(**{k: _decode(hints[k], v) for k, v in data.items() if k in known})


@functools.cache
def _field_hints(cls: type[Record]) -> tuple[dict[str, Any], frozenset[str]]:
    """A record class's resolved field types and names, once per class: resolving the string
    annotations is ~0.4 ms a call, and a bundle.json decodes ~300 records (0.11 s of startup)."""
    return get_type_hints(cls), frozenset(f.name for f in fields(cls))  # type: ignore[arg-type]


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
    # "blocked-rows" (cpu decode: per-row reductions sharing each blocked weight tile),
    # "blocked-bmm" (cpu prefill: bmm over the blocks), "reduction" (one row, plain weights),
    # "mm" (a library GEMM), "dot" (HLO)
    projection: str | None = None

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
        return data


@dataclass(frozen=True)
class BucketLists(Record):
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    context: tuple[int, ...]
    prefill_batch: tuple[int, ...] = (1,)  # rows of the prefill graphs (packed prompts)


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
    # logprobs the graphs return per sampled token (0: a bundle from before logprobs)
    max_logprobs: int = 0
    prompt_logprobs: bool = False  # prefill graphs return the prompt's own logprobs (echo)
    # "mha": a K and a V tensor per layer; "mla": one latent tensor per layer (DeepSeek), whose
    # head_dim is the per-token width kv_lora_rank + qk_rope_head_dim, with one "head"
    kv_kind: str = "mha"
    # the cache tensors' dtype: the model dtype, or float8_e4m3fn (kv_cache.dtype); "" = dtype
    kv_dtype: str = ""
    # "device": graphs take the aliased `last_tokens` state after the caches (decode reads its
    # tokens there; the host sends `seq_slots`); "host": decode takes `input_ids`
    decode_state: str = "host"

    @property
    def state_names(self) -> list[str]:
        """The device-resident state tensors' graph input names (after the caches)."""
        return ["last_tokens"] if self.decode_state == "device" else []

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """[num_blocks, block_size, kv_heads_per_rank, head_dim] of each cache tensor."""
        return (self.num_blocks, self.block_size, self.kv_heads_per_rank, self.head_dim)

    @property
    def kv_names(self) -> list[str]:
        """The cache tensors' graph input names, in order."""
        kinds = ("kv",) if self.kv_kind == "mla" else ("k", "v")
        return [f"{kind}_cache.{i}" for i in range(self.num_layers) for kind in kinds]

    @property
    def kv_itemsize(self) -> int:
        return DTYPE_BYTES[self.cache_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes on one rank, every layer."""
        return len(self.kv_names) * self.kv_heads_per_rank * self.head_dim * self.kv_itemsize


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
        return _encode(self.config)  # type: ignore[return-value]

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
        return _encode(self.resolved)  # type: ignore[return-value]

    @classmethod
    def from_json(cls, data: JsonObject) -> ManifestRecord:
        return cls(data["name"], data["model"], dict(data))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Fp8Record(Record):
    """fp8 in this bundle: which values are fp8, the range they use, the build-time rescale."""

    max: float  # the largest magnitude an fp8 value holds: 240 on trn1/trn2, else 448
    weights: str  # the checkpoint's scale layout: "block", "channel", "tensor"; "" unquantized
    weight_block: tuple[int, ...]  # its scale block [out, in] (0 spans the dimension)
    weight_rescale: float  # fp8 weights were multiplied by this at build time (240/448, or 1)
    scale_rescale: float  # and their scales by this (448/240, or 1)
    kv_cache: bool  # the KV cache is fp8
    kv_scales: str  # "checkpoint" (per-layer k_scale / v_scale), "1.0", or "" (no fp8 cache)


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


def write_bundle_json(root: Path, record: BundleRecord) -> BundleRecord:
    """Hash every file in `root` into the record's `files`; write bundle.json (sorted, stable)."""
    record = replace(
        record,
        format=FORMAT_VERSION,
        files={rel: sha256_file(root / rel) for rel in list_files(root)},
    )
    (root / BUNDLE_JSON).write_text(json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n")
    return record


@dataclass(frozen=True)
class Bundle:
    """An opened bundle: where it is and its typed record."""

    root: Path
    record: BundleRecord

    @property
    def target(self) -> str:
        return self.record.target

    @property
    def graphs(self) -> tuple[GraphRecord, ...]:
        return self.record.graphs

    @property
    def digest(self) -> str:
        """sha256 of bundle.json: names this exact bundle (files included, through their hashes)."""
        return sha256_file(self.root / BUNDLE_JSON)

    def path(self, rel: str) -> Path:
        return self.root / rel


def rank_files(record: BundleRecord, rank: int) -> list[str]:
    """The files one rank reads when it loads: its graphs, its weight shard, the tokenizer."""
    graphs = [g.artifact or g.hlo or "" for g in record.graphs if g.serves(rank)]
    prefix = f"{record.tokenizer}/" if record.tokenizer else None
    tokenizer = [f for f in record.files if prefix and f.startswith(prefix)]
    return [*graphs, *record.kernels, record.weights_of(rank).file, *tokenizer]


def read_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Open a bundle directory, or a packed bundle (BUNDLE.tar.zst: extracted once into the
    bundle cache, every file checked); check its format and (by default) every file's sha256."""
    root = Path(path)
    if is_pack(root):
        from neffkit.bundle_pack import unpack_bundle

        root = unpack_bundle(root)
    meta = root / BUNDLE_JSON
    if not root.is_dir():
        raise BundleError(
            f"{root}: not a directory (a bundle is the directory `neffkit build` wrote)"
        )
    if not meta.exists():
        raise BundleError(
            f"{root}: no {BUNDLE_JSON}; this is not a neffkit bundle",
            hint="build one with `neffkit build MANIFEST`",
        )
    try:
        data = json.loads(meta.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{meta}: corrupt JSON: {exc}", hint="rebuild the bundle") from exc
    fmt = data.get("format")
    if fmt != FORMAT_VERSION:
        raise BundleError(
            f"{meta}: bundle format {fmt!r} is not supported; this neffkit reads format "
            f"{FORMAT_VERSION}",
            hint="rebuild the bundle with this neffkit, or install the neffkit that built it",
        )
    try:
        record = BundleRecord.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(
            f"{meta}: bundle.json does not match format {FORMAT_VERSION} ({exc!r} is missing or "
            "malformed)",
            hint="rebuild the bundle with this neffkit",
        ) from exc
    bundle = Bundle(root, record)
    if verify:
        verify_files(bundle)
    return bundle


def verify_files(bundle: Bundle, only: Iterable[str] | None = None, workers: int = 4) -> None:
    """Listed files exist with their recorded hashes (all of them, or `only` those: what one
    rank reads), hashed in parallel threads (hashlib releases the GIL); and no listed graph
    file is missing."""
    files = bundle.record.files
    chosen = sorted(files if only is None else set(only) & set(files))
    for rel in chosen:
        if not (bundle.root / rel).is_file():
            raise BundleError(
                f"{bundle.root}: file {rel} is missing",
                hint="the bundle is incomplete; copy it again or rebuild",
            )
    with ThreadPoolExecutor(max_workers=workers) as pool:
        hashes = pool.map(lambda rel: sha256_file(bundle.root / rel), chosen)
        actual = dict(zip(chosen, hashes, strict=True))
    for rel in chosen:
        if actual[rel] != files[rel]:
            raise BundleError(
                f"{bundle.root}: file {rel} is corrupt (sha256 {actual[rel][:12]}…, expected "
                f"{files[rel][:12]}…)",
                hint="the bundle was modified or damaged in transit; copy it again or rebuild",
            )
    for graph in bundle.graphs:
        # a lowered neuron bundle has no artifact yet: its HLO module must be there instead
        if (graph.artifact or graph.hlo) not in files:
            raise BundleError(f"{bundle.root}: graph {graph.name} has no listed artifact")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(parent: Path, prefix: str) -> None:
    """Remove `<prefix><pid>-*` temp dirs whose process is gone (a SIGKILLed build)."""
    if not parent.is_dir():
        return
    for path in parent.glob(f"{prefix}*"):
        pid_text = path.name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staging_dir(dest: Path) -> Iterator[Path]:
    """A temp directory beside `dest`, renamed onto `dest` only if the block completes.

    On any exception (Ctrl-C included) the temp directory is removed and `dest` is untouched, so a
    failed build never leaves a half-written bundle.
    """
    dest = dest.resolve()
    if dest.exists() and not (dest / BUNDLE_JSON).exists():
        raise BundleError(
            f"{dest}: exists and is not a bundle; refusing to overwrite it",
            hint="choose another output directory with -o",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(dest.parent, f".{dest.name}.tmp-")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            old = Path(
                tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-old-", dir=dest.parent)
            )
            os.replace(dest, old / "bundle")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
