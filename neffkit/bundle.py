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

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import zstandard

from neffkit.errors import BundleError

FORMAT_VERSION = 1
BUNDLE_JSON = "bundle.json"


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


def _drop_none(data: JsonObject) -> JsonObject:
    return {k: v for k, v in data.items() if v is not None}


@dataclass(frozen=True)
class TensorRecord:
    """A graph input or output: name, static shape, dtype name (torch's spelling)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> JsonObject:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: JsonObject) -> TensorRecord:
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class IoAlias:
    """Graph output `output` is written back into input `input` (the KV cache, in place)."""

    input: str
    output: int

    def to_json(self) -> JsonObject:
        return {"input": self.input, "output": self.output}

    @classmethod
    def from_json(cls, d: JsonObject) -> IoAlias:
        return cls(d["input"], d["output"])


@dataclass(frozen=True)
class GraphBuckets:
    rows: int
    tokens: int
    context: int

    def to_json(self) -> JsonObject:
        return {"rows": self.rows, "tokens": self.tokens, "context": self.context}

    @classmethod
    def from_json(cls, d: JsonObject) -> GraphBuckets:
        return cls(d["rows"], d["tokens"], d["context"])


@dataclass(frozen=True)
class VerifyRecord:
    """`build --verify`'s result for one graph, or why it was skipped."""

    ok: bool | None = None
    tokens_equal: bool | None = None
    max_kv_error: float | None = None
    tolerance: float | None = None
    executor: str | None = None
    skipped: str | None = None

    def to_json(self) -> JsonObject:
        return _drop_none(dict(self.__dict__))

    @classmethod
    def from_json(cls, d: JsonObject) -> VerifyRecord:
        return cls(**d)


@dataclass(frozen=True)
class CompilerRecord:
    """How neuronx-cc made one NEFF: its argv (paths relative to the bundle), version, log."""

    argv: tuple[str, ...]
    version: str
    log: str

    def to_json(self) -> JsonObject:
        return {"argv": list(self.argv), "version": self.version, "log": self.log}

    @classmethod
    def from_json(cls, d: JsonObject) -> CompilerRecord:
        return cls(tuple(d["argv"]), d["version"], d["log"])


@dataclass(frozen=True)
class ArtifactMetadata:
    """What the compiler says about an artifact: AOTInductor's own metadata (cpu, cuda) or the
    NEFF header as the build read it (neuron; the loader compares the file against it)."""

    aotinductor: dict[str, str] = field(default_factory=dict)
    neff_header: dict[str, int | str] | None = None

    def to_json(self) -> JsonObject:
        if self.neff_header is not None:
            return {"neff_header": dict(self.neff_header)}
        return dict(self.aotinductor)

    @classmethod
    def from_json(cls, d: JsonObject) -> ArtifactMetadata:
        if "neff_header" in d:
            return cls(neff_header=d["neff_header"])
        return cls(aotinductor=dict(d))


@dataclass(frozen=True)
class GraphRecord:
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

    @property
    def stem(self) -> str:
        """File stem of this graph's ir/ and artifact files (per-rank graphs carry their rank)."""
        return Path(self.ir).name.removesuffix(".txt.zst")

    def serves(self, rank: int) -> bool:
        return self.ranks == "all" or rank in self.ranks

    def to_json(self) -> JsonObject:
        neuron: JsonObject = {}
        if self.hlo is not None:
            neuron = {
                "hlo": self.hlo,
                "hlo_text": self.hlo_text,
                "hlo_sha256": self.hlo_sha256,
                "compiler": self.compiler.to_json() if self.compiler else None,
            }
        return {
            **neuron,
            "name": self.name,
            "phase": self.phase,
            "buckets": self.buckets.to_json(),
            "artifact": self.artifact,
            "verify": self.verify.to_json() if self.verify else None,
            "ir": self.ir,
            "graph_sha256": self.graph_sha256,
            "cache_key": self.cache_key,
            "options": dict(self.options),
            "option_origins": dict(self.option_origins),
            "flags": list(self.flags),
            "flag_origins": dict(self.flag_origins),
            "io_alias": [a.to_json() for a in self.io_alias],
            "inputs": [i.to_json() for i in self.inputs],
            "outputs": [o.to_json() for o in self.outputs],
            "ranks": self.ranks if self.ranks == "all" else list(self.ranks),
            "artifact_metadata": self.artifact_metadata.to_json(),
        }

    @classmethod
    def from_json(cls, d: JsonObject) -> GraphRecord:
        compiler, verify = d.get("compiler"), d.get("verify")
        return cls(
            name=d["name"],
            phase=d["phase"],
            buckets=GraphBuckets.from_json(d["buckets"]),
            artifact=d["artifact"],
            ir=d["ir"],
            graph_sha256=d["graph_sha256"],
            cache_key=d.get("cache_key"),
            options=dict(d.get("options", {})),
            option_origins=dict(d.get("option_origins", {})),
            flags=tuple(d.get("flags", [])),
            flag_origins=dict(d.get("flag_origins", {})),
            io_alias=tuple(IoAlias.from_json(a) for a in d["io_alias"]),
            inputs=tuple(TensorRecord.from_json(i) for i in d["inputs"]),
            outputs=tuple(TensorRecord.from_json(o) for o in d["outputs"]),
            ranks=d["ranks"] if d["ranks"] == "all" else tuple(d["ranks"]),
            artifact_metadata=ArtifactMetadata.from_json(d.get("artifact_metadata", {})),
            verify=VerifyRecord.from_json(verify) if verify else None,
            hlo=d.get("hlo"),
            hlo_text=d.get("hlo_text"),
            hlo_sha256=d.get("hlo_sha256"),
            compiler=CompilerRecord.from_json(compiler) if compiler else None,
        )


@dataclass(frozen=True)
class BucketLists:
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    context: tuple[int, ...]

    def to_json(self) -> JsonObject:
        return {
            "prefill": list(self.prefill),
            "decode": list(self.decode),
            "context": list(self.context),
        }

    @classmethod
    def from_json(cls, d: JsonObject) -> BucketLists:
        return cls(tuple(d["prefill"]), tuple(d["decode"]), tuple(d["context"]))


@dataclass(frozen=True)
class LayoutRecord:
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
    max_top_k: int

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """[num_blocks, block_size, kv_heads_per_rank, head_dim], one K and one V per layer."""
        return (self.num_blocks, self.block_size, self.kv_heads_per_rank, self.head_dim)

    def to_json(self) -> JsonObject:
        return {**self.__dict__, "buckets": self.buckets.to_json()}

    @classmethod
    def from_json(cls, d: JsonObject) -> LayoutRecord:
        return cls(**{**d, "buckets": BucketLists.from_json(d["buckets"])})


@dataclass(frozen=True)
class WeightsRecord:
    """One rank's pre-cut shard: its file and tensor names in graph-input order."""

    rank: int
    file: str
    names: tuple[str, ...]

    def to_json(self) -> JsonObject:
        return {"rank": self.rank, "file": self.file, "names": list(self.names)}

    @classmethod
    def from_json(cls, d: JsonObject) -> WeightsRecord:
        return cls(d["rank"], d["file"], tuple(d["names"]))


@dataclass(frozen=True)
class Versions:
    neffkit: str
    torch: str
    backend: str

    def to_json(self) -> JsonObject:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: JsonObject) -> Versions:
        return cls(**d)


@dataclass(frozen=True)
class HostRecord:
    """What the artifacts need of the host that runs them (none for NEFFs: checked per header)."""

    machine: str | None = None
    cpu_flags: tuple[str, ...] | None = None
    cuda_capability: str | None = None

    def to_json(self) -> JsonObject:
        data = _drop_none(dict(self.__dict__))
        if self.cpu_flags is not None:
            data["cpu_flags"] = list(self.cpu_flags)
        return data

    @classmethod
    def from_json(cls, d: JsonObject) -> HostRecord:
        flags = d.get("cpu_flags")
        return cls(d.get("machine"), tuple(flags) if flags is not None else None,
                   d.get("cuda_capability"))  # fmt: skip


@dataclass(frozen=True)
class NeuronRecord:
    target: str  # trn1 | trn2 | trn3
    lnc: int

    def to_json(self) -> JsonObject:
        return {"target": self.target, "lnc": self.lnc}

    @classmethod
    def from_json(cls, d: JsonObject) -> NeuronRecord:
        return cls(d["target"], d["lnc"])


@dataclass(frozen=True)
class FindingRecord:
    """One audit finding: rule id, severity, graph, the node or flag it points at, a fix."""

    rule: str
    severity: str
    graph: str
    at: str  # node ("%12 = aten.index_put...") or flag
    message: str
    fix: str
    waived: bool = False

    def to_json(self) -> JsonObject:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: JsonObject) -> FindingRecord:
        return cls(**d)


@dataclass(frozen=True)
class AuditRecord:
    waived: tuple[str, ...] = ()
    findings: tuple[FindingRecord, ...] = ()

    def to_json(self) -> JsonObject:
        return {"waived": list(self.waived), "findings": [f.to_json() for f in self.findings]}

    @classmethod
    def from_json(cls, d: JsonObject) -> AuditRecord:
        return cls(tuple(d.get("waived", [])),
                   tuple(FindingRecord.from_json(f) for f in d.get("findings", [])))  # fmt: skip


@dataclass(frozen=True)
class ModelRecord:
    """The resolved model config, verbatim (provenance), with the fields the runtime reads typed."""

    architecture: str
    num_layers: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    config: JsonObject

    def to_json(self) -> JsonObject:
        return dict(self.config)

    @classmethod
    def from_json(cls, d: JsonObject) -> ModelRecord:
        return cls(d["architecture"], d["num_layers"], d["vocab_size"],
                   tuple(d["eos_token_ids"]), dict(d))  # fmt: skip


@dataclass(frozen=True)
class ManifestRecord:
    """The resolved manifest, verbatim (provenance), with the fields readers need typed."""

    name: str
    model_dir: str
    resolved: JsonObject

    def to_json(self) -> JsonObject:
        return dict(self.resolved)

    @classmethod
    def from_json(cls, d: JsonObject) -> ManifestRecord:
        return cls(d["name"], d["model"], dict(d))


@dataclass(frozen=True)
class BundleRecord:
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
    files: dict[str, str] = field(default_factory=dict)  # path → sha256, bundle.json excluded
    format: int = FORMAT_VERSION

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
        data: JsonObject = {
            "format": self.format,
            "versions": self.versions.to_json(),
            "target": self.target,
            "host": self.host.to_json(),
            "manifest": self.manifest.to_json(),
            "model": self.model.to_json(),
            "layout": self.layout.to_json(),
            "graphs": [g.to_json() for g in self.graphs],
            "weights": [w.to_json() for w in self.weights],
            "tokenizer": self.tokenizer,
            "audit": self.audit.to_json(),
            "files": dict(self.files),
        }
        if self.neuron is not None:
            data["neuron"] = self.neuron.to_json()
            data["stage"] = self.stage
        return data

    @classmethod
    def from_json(cls, d: JsonObject) -> BundleRecord:
        return cls(
            versions=Versions.from_json(d["versions"]),
            target=d["target"],
            host=HostRecord.from_json(d.get("host", {})),
            manifest=ManifestRecord.from_json(d["manifest"]),
            model=ModelRecord.from_json(d["model"]),
            layout=LayoutRecord.from_json(d["layout"]),
            graphs=tuple(GraphRecord.from_json(g) for g in d["graphs"]),
            weights=tuple(WeightsRecord.from_json(w) for w in d["weights"]),
            tokenizer=d.get("tokenizer"),
            audit=AuditRecord.from_json(d.get("audit", {})),
            neuron=NeuronRecord.from_json(d["neuron"]) if d.get("neuron") else None,
            stage=d.get("stage"),
            files=dict(d.get("files", {})),
            format=d["format"],
        )


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


def read_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Open a bundle directory; check its format and (by default) every file's sha256."""
    root = Path(path)
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


def verify_files(bundle: Bundle) -> None:
    """Every listed file exists with its recorded hash, and no listed graph file is missing."""
    files = bundle.record.files
    for rel, expected in files.items():
        file = bundle.root / rel
        if not file.is_file():
            raise BundleError(
                f"{bundle.root}: file {rel} is missing",
                hint="the bundle is incomplete; copy it again or rebuild",
            )
        actual = sha256_file(file)
        if actual != expected:
            raise BundleError(
                f"{bundle.root}: file {rel} is corrupt (sha256 {actual[:12]}…, expected "
                f"{expected[:12]}…)",
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
