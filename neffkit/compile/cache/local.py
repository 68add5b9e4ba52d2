"""The artifact cache in a local (or shared, POSIX) directory: entries published by rename.

An entry is `entries/<sha256 of the key factors>/` holding the artifact and `key.json` (the factors
and the artifact's sha256). Entries are written into `tmp/` and renamed into place, so a killed
build never leaves a half-written entry and builds sharing one directory are safe (if two builds
race to the same key, the first rename wins and the second discards its copy). `labels/` remembers
the factors each graph was last compiled with, so a miss can say which factor changed. `traces/`
holds the early key's entries (keys.py) as data (traces.py): reading an entry runs no code.
key.json's artifact name is a plain file name of its entry (no `/`, no `..`), else the entry is
corrupt; the cache is still trusted as much as the compiled artifacts it holds, which are
executable code (docs/builds.md#what-must-be-trusted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from neffkit.compile.cache.traces import TRACE_SUFFIX, decode_trace, encode_trace
from neffkit.compile.units import CacheKey, TraceResult
from neffkit.contract.bundle import sha256_file
from neffkit.contract.codec import JsonObject
from neffkit.contract.tempdirs import remove_stale_temp_dirs

log = logging.getLogger(__name__)
KEY_JSON = "key.json"


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
            name = meta["artifact"]
            artifact = entry / name if plain_name(name) else None
            if (
                artifact is not None
                and not artifact.is_symlink()
                and sha256_file(artifact) == meta["artifact_sha256"]
            ):
                return artifact
        except (OSError, ValueError, KeyError, TypeError):
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
        """The trace stored under an early key, or None (a missing or unsound entry)."""
        try:
            data = (self.traces / f"{key.digest}{TRACE_SUFFIX}").read_bytes()
        except OSError:
            return None
        return decode_trace(data, key.digest)

    def store_trace(self, key: CacheKey, trace: TraceResult) -> None:
        """Write a trace entry atomically: a temp file renamed into place."""
        if self.readonly:
            return
        fd, tmp = tempfile.mkstemp(prefix=f"{os.getpid()}-", dir=self.tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(encode_trace(trace))
        os.replace(tmp, self.traces / f"{key.digest}{TRACE_SUFFIX}")

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


def plain_name(value: object) -> bool:
    """A file name that stays in the directory it is joined to: no `/`, `\\`, NUL, `.` or `..`
    (what key.json may name, local or remote)."""
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in "/\\\0")
    )


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
