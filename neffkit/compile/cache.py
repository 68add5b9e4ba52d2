"""Content-addressed artifact cache.

An entry is `entries/<sha256 of the key factors>/` holding the artifact and `key.json` (the factors
and the artifact's sha256). Entries are written into `tmp/` and renamed into place, so a killed
build never leaves a half-written entry and builds sharing one directory are safe (if two builds
race to the same key, the first rename wins and the second discards its copy). `labels/` remembers
the factors each graph was last compiled with, so a miss can say which factor changed. Environment
variables never enter a key; only what changes the artifact does.

`traces/` holds DESIGN.md's early key: everything a graph's trace is made from (resolved manifest,
model config, checkpoint file stamps, neffkit's own source, torch and lowering versions, the graph
spec and rank) → the trace itself, so a rebuild with nothing changed traces nothing. A wrong hit
there could only come from a factor left out; it still cannot give a wrong artifact, whose key is
the traced graph. Trace entries are pickles: the cache is trusted as much as the compiled
artifacts it holds, which are executable code.

The cache can also live anywhere fsspec reaches (`s3://bucket/prefix`, `gs://…`): see
`remote_cache.py`; `open_cache` picks. A read-only cache (`--cache-readonly`: serving hosts,
untrusted CI) is looked up but never written, corrupt entries included.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffkit.bundle import (
    FORMAT_VERSION,
    ArtifactMetadata,
    CompilerRecord,
    JsonObject,
    remove_stale_temp_dirs,
    sha256_file,
)

if TYPE_CHECKING:
    from neffkit.compile.backends.base import Backend
    from neffkit.compile.plan import GraphSpec
    from neffkit.compile.progress import Progress
    from neffkit.compile.remote_cache import RemoteArtifactCache
    from neffkit.compile.units import GraphUnit, TraceResult
    from neffkit.manifest import Manifest

log = logging.getLogger(__name__)
KEY_JSON = "key.json"


def default_cache_dir() -> str:
    """$NEFFKIT_CACHE (a directory or an fsspec URL), else ~/.cache/neffkit."""
    return os.environ.get("NEFFKIT_CACHE") or str(Path.home() / ".cache" / "neffkit")


def is_url(location: str | Path) -> bool:
    return isinstance(location, str) and "://" in location


def open_cache(location: str | Path, readonly: bool = False) -> ArtifactCache | RemoteArtifactCache:
    """The cache at `location`: a local directory (`file://` included), or an fsspec URL."""
    if is_url(location) and not str(location).startswith("file://"):
        from neffkit.compile.remote_cache import RemoteArtifactCache

        return RemoteArtifactCache(str(location), readonly)
    path = str(location).removeprefix("file://")
    return ArtifactCache(Path(path).expanduser(), readonly)


@dataclass(frozen=True)
class CacheKey:
    """Every factor that changes a compiled artifact, and nothing else."""

    factors: JsonObject

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.factors, sort_keys=True).encode()).hexdigest()


def _describe(value: Any) -> str:
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) or "(none)"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    return str(value)


def changed_keys(old: dict[Any, Any], new: dict[Any, Any]) -> list[Any]:
    """The keys, sorted, whose values differ between two dicts (a key only one has counts)."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def explain_change(old: JsonObject, new: JsonObject) -> str:
    """`flags changed: -O2 → -O3; torch changed: 2.12.0 → 2.13.0`."""
    parts = []
    for name in changed_keys(old, new):
        before, after = old.get(name), new.get(name)
        if name in ("graph", "inputs", "outputs"):
            parts.append(f"{name} changed")
        elif isinstance(before, dict) and isinstance(after, dict):  # only the keys that changed
            changes = [
                f"{k}={before.get(k, '(unset)')} → {after.get(k, '(unset)')}"
                for k in changed_keys(before, after)
            ]
            parts.append(f"{name} changed: {', '.join(changes)}")
        else:
            parts.append(f"{name} changed: {_describe(before)} → {_describe(after)}")
    return "; ".join(parts) or "no factor changed (entry missing or corrupt)"


class ArtifactCache:
    """The cache in a local (or shared, POSIX) directory: entries published by rename."""

    def __init__(self, root: Path, readonly: bool = False) -> None:
        self.root = Path(root)
        self.readonly = readonly
        self.entries = self.root / "entries"
        self.labels = self.root / "labels"
        self.tmp = self.root / "tmp"
        self.traces = self.root / "traces"
        if readonly:  # touch nothing: the directory may not even be writable
            return
        for d in (self.entries, self.labels, self.tmp, self.traces):
            d.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(self.tmp, "")

    def _entry(self, key: CacheKey) -> Path:
        return self.entries / key.digest

    def lookup(self, key: CacheKey) -> Path | None:
        """The cached artifact for `key`, or None. A corrupt entry is removed: a miss."""
        entry = self._entry(key)
        meta_path = entry / KEY_JSON
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            artifact = entry / meta["artifact"]
            if sha256_file(artifact) == meta["artifact_sha256"]:
                return artifact
        except (OSError, ValueError, KeyError):
            pass
        log.warning("cache entry %s is corrupt; recompiling", entry.name)
        if not self.readonly:
            shutil.rmtree(entry, ignore_errors=True)
        return None

    def store(
        self, key: CacheKey, artifact: Path, extra: JsonObject | None = None, link: bool = False
    ) -> Path:
        """Copy `artifact` into a new entry atomically; return the cached artifact's path.

        `link` (weight shards): reflink or hardlink where the filesystem allows, else copy.
        A read-only cache stores nothing and returns `artifact`."""
        if self.readonly:
            return artifact
        tmp = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.tmp))
        try:
            if link:
                link_or_copy(artifact, tmp / artifact.name)
            else:
                shutil.copyfile(artifact, tmp / artifact.name)
            meta = {
                "factors": key.factors,
                "artifact": artifact.name,
                "artifact_sha256": sha256_file(tmp / artifact.name),
                **(extra or {}),
            }
            (tmp / KEY_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            try:
                os.replace(tmp, self._entry(key))
            except OSError:  # another build stored the same key first: keep theirs
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return self._entry(key) / artifact.name

    def lookup_trace(self, key: CacheKey) -> TraceResult | None:
        """The trace stored under an early key, or None (a missing or unreadable entry)."""
        try:
            data = (self.traces / f"{key.digest}.pkl").read_bytes()
            return pickle.loads(data)  # noqa: S301 (our own cache; see the module docstring)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            return None

    def store_trace(self, key: CacheKey, trace: TraceResult) -> None:
        """Write a trace entry atomically: a temp file renamed into place."""
        if self.readonly:
            return
        fd, tmp = tempfile.mkstemp(prefix=f"{os.getpid()}-", dir=self.tmp)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(trace, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.traces / f"{key.digest}.pkl")

    def _label_path(self, label: str) -> Path:
        return self.labels / (hashlib.sha256(label.encode()).hexdigest()[:32] + ".json")

    def previous_factors(self, label: str) -> JsonObject | None:
        try:
            return json.loads(self._label_path(label).read_text())["factors"]
        except (OSError, ValueError, KeyError):
            return None

    def remember(self, label: str, key: CacheKey) -> None:
        """Record (atomically) the factors `label` (manifest/graph) was last built with."""
        if self.readonly:
            return
        path = self._label_path(label)
        fd, tmp = tempfile.mkstemp(prefix=f"{os.getpid()}-", dir=self.tmp)
        with os.fdopen(fd, "w") as f:
            json.dump({"label": label, "factors": key.factors}, f, sort_keys=True)
        os.replace(tmp, path)


if TYPE_CHECKING:
    Cache = ArtifactCache | RemoteArtifactCache  # one interface, two stores


def link_or_copy(src: Path, dst: Path) -> str:
    """Place `src` at `dst` without copying bytes where the filesystem allows: a reflink
    (copy-on-write clone: btrfs, xfs), else a hardlink, else a copy. Returns which it used.

    A hardlinked bundle file shares its inode with the cache entry; the entry's sha256 is
    checked on every lookup, so an edit through the bundle makes the entry a miss, not a wrong
    hit."""
    import fcntl

    ficlone = 0x40049409  # linux/fs.h FICLONE
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), ficlone, s.fileno())
        return "reflink"
    except OSError:
        dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
        return "hardlink"
    except OSError:
        shutil.copyfile(src, dst)
        return "copy"


# ---------------------------------------------------------------- the early key (traces)

LOWERING_PACKAGES = ("torch-mlir", "jax", "jaxlib")


@functools.cache
def source_digest() -> str:
    """sha256 over neffkit's own source (Python, and the C++ kernels the graphs call): any code
    change invalidates every trace entry."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.glob("csrc/*")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def checkpoint_stamps(model_dir: Path) -> list[list[str | int]]:
    """(name, size, mtime_ns) of every file in the model directory: what the trace reads."""
    return [
        [p.name, st.st_size, st.st_mtime_ns]
        for p in sorted(Path(model_dir).iterdir())
        if p.is_file() and (st := p.stat())
    ]


def _installed(names: tuple[str, ...]) -> dict[str, str]:
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def trace_key(manifest: Manifest, backend: Backend, spec: GraphSpec, rank: int) -> CacheKey:
    """Everything one rank's trace of one graph is made from (DESIGN.md "Cache", early key)."""
    import torch

    return CacheKey(
        {
            "kind": "trace",
            "manifest": manifest.to_json(),
            "model": manifest.model_config.to_json(),
            "checkpoint": checkpoint_stamps(manifest.model),
            "neffkit": source_digest(),
            "torch": torch.__version__,
            "python": list(sys.version_info[:2]),
            "lowering": _installed(LOWERING_PACKAGES) if backend.name == "neuron" else {},
            "backend": f"{backend.name} {backend.version}",
            # cpu_kernel: auto takes the kernel only where the CPU runs it
            "cpu_kernel": _cpu_kernel_runs() if backend.name == "cpu" else None,
            "graph": asdict(spec),
            "rank": rank,
            "format": FORMAT_VERSION,
        }
    )


def _cpu_kernel_runs() -> bool:
    from neffkit import cpu_kernels

    return cpu_kernels.supported()


def weights_key(manifest: Manifest, rank: int, storage: JsonObject) -> CacheKey:
    """Everything one rank's weight shard is made from: the checkpoint, how it is stored (dtype,
    fp8 rescale, k/v scales: trace.weight_storage), the layout, the code."""
    par = manifest.parallel
    return CacheKey(
        {
            "kind": "weights",
            "model_dir": str(manifest.model),
            "checkpoint": checkpoint_stamps(manifest.model),
            "model": manifest.model_config.to_json(),
            "storage": storage,
            "parallel": {"tp": par.tp, "ep": par.ep},
            "rank": rank,
            "neffkit": source_digest(),
            "format": FORMAT_VERSION,
        }
    )


# ---------------------------------------------------------------- graph units (the build's view)


def lookup_units(
    cache: Cache | None,
    units: list[GraphUnit],
    backend: Backend,
    manifest: Manifest,
    progress: Progress,
) -> None:
    """Each unit's cache key, and its cached artifact or why it missed."""
    host = backend.host_requirements().to_json()
    for u in units:
        u.key = unit_key(u, backend, host, manifest)
        if cache is None:
            continue
        u.cached = cache.lookup(u.key)
        if u.cached is None:
            previous = cache.previous_factors(_label(manifest, u))
            if previous is not None:
                u.miss_reason = explain_change(previous, u.key.factors)
                progress.message(f"{u.stem}: recompiling, {u.miss_reason}")


def unit_key(u: GraphUnit, backend: Backend, host: JsonObject, manifest: Manifest) -> CacheKey:
    import torch

    return CacheKey(
        {
            **backend.cache_factors(u, manifest),
            "graph": u.trace.graph_sha256,
            "inputs": [i.to_json() for i in u.trace.inputs],
            "outputs": [o.to_json() for o in u.trace.outputs],
            "options": u.options.inductor,
            "flags": list(u.options.cache_flags()),
            "backend": f"{backend.name} {backend.version}",
            "torch": torch.__version__,
            "host": host,
            "format": FORMAT_VERSION,
        }
    )


def store_unit(cache: Cache, u: GraphUnit, artifact: Path) -> None:
    """Cache a freshly compiled artifact with what a hit must restore (metadata, compiler)."""
    assert u.key is not None
    extra: JsonObject = {"artifact_metadata": u.metadata.to_json()}
    if u.compiler is not None:
        extra["compiler"] = u.compiler.to_json()
    cache.store(u.key, artifact, extra)


def restore_unit(u: GraphUnit) -> None:
    """A hit's artifact metadata and compiler record, from its entry's key.json."""
    assert u.cached is not None
    entry = json.loads((u.cached.parent / KEY_JSON).read_text())
    compiler = entry.get("compiler")
    u.metadata = ArtifactMetadata.from_json(entry.get("artifact_metadata", {}))
    u.compiler = CompilerRecord.from_json(compiler) if compiler else None


def remember_unit(cache: Cache, manifest: Manifest, u: GraphUnit) -> None:
    assert u.key is not None
    cache.remember(_label(manifest, u), u.key)


def _label(manifest: Manifest, u: GraphUnit) -> str:
    return f"{manifest.name}/{u.stem}"
