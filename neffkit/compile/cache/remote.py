"""The artifact cache on a filesystem fsspec reaches: `s3://bucket/prefix`, `gs://…`, `memory://`.

Same entries as the local cache (cache.py), published for stores that have no rename:

    entries/<digest>/<sha256[:16]>-<artifact name>   uploaded first (content-addressed object)
    entries/<digest>/key.json                         written last: the entry exists from then on

A reader trusts only an entry whose key.json exists, downloads the object key.json names and
checks its sha256 before using it, so an interrupted upload (an object with no key.json, or a
key.json whose object is short or missing) is a miss, never a wrong artifact. Two writers of one
key each upload their own object and write a key.json naming it: whichever key.json lands last
names a complete object, so racing writers are harmless. Traces and labels are single objects
(`traces/<digest>.json.zst`, data only (traces.py), and `labels/<h>.json`): one PUT each.

Whoever can write the store is not trusted with the builder's files or process: key.json's
`artifact` and `object` must be plain file names (else the entry is ignored), a download lands
in a fresh temporary directory and is deleted when its hash is wrong, and no entry is ever
unpickled. What such a writer can still do is in docs/builds.md#what-must-be-trusted.

Downloaded artifacts are kept in a local mirror (an ArtifactCache under
$NEFFKIT_CACHE_MIRROR, else ~/.cache/neffkit-remote/<url hash>), used again while the remote
key.json still names the same sha256. fsspec and the protocol's package (s3fs, gcsfs) are imported
only here, only for a URL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffkit.compile.cache.local import KEY_JSON, ArtifactCache, plain_name
from neffkit.compile.cache.traces import TRACE_SUFFIX, decode_trace, encode_trace
from neffkit.compile.units import CacheKey
from neffkit.contract.bundle import sha256_file
from neffkit.contract.codec import JsonObject
from neffkit.errors import BuildError

if TYPE_CHECKING:
    from neffkit.compile.units import TraceResult

log = logging.getLogger(__name__)


def mirror_dir(url: str) -> Path:
    """The local directory holding this URL's downloaded entries."""
    if os.environ.get("NEFFKIT_CACHE_MIRROR"):
        base = Path(os.environ["NEFFKIT_CACHE_MIRROR"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "neffkit-remote"
    return base / hashlib.sha256(url.encode()).hexdigest()[:16]


class RemoteArtifactCache:
    """ArtifactCache's interface over fsspec (lookup/store, traces, labels)."""

    def __init__(self, url: str, readonly: bool = False, mirror: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.readonly = readonly
        try:
            import fsspec

            self.fs, self.base = fsspec.core.url_to_fs(self.url)
            self.fs.exists(self.base)  # reachable, with these credentials
        except ImportError as exc:
            raise BuildError(
                f"--cache {url}: {exc}",
                hint="install the protocol's fsspec package: pip install 'neffkit[remote]'",
            ) from None
        except Exception as exc:  # credentials, endpoint, bucket: say which URL, not a traceback
            reason = f"{type(exc).__name__}: {exc}"
            raise BuildError(f"--cache {url}: cannot read it ({reason})") from None
        self.mirror = ArtifactCache(mirror or mirror_dir(self.url))

    def _path(self, *parts: str) -> str:
        return "/".join([self.base.rstrip("/"), *parts])

    def _read(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def _write(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data)
        except Exception as exc:
            raise BuildError(f"--cache {self.url}: cannot write {path} ({exc})") from None

    # ------------------------------------------------------------ artifacts

    def lookup(self, key: CacheKey) -> Path | None:
        """A local copy of the published artifact for `key` (hash checked), or None."""
        entry = self._path("entries", key.digest)
        raw = self._read(f"{entry}/{KEY_JSON}")
        if raw is None:  # never published (or an upload that stopped before key.json)
            return None
        try:
            meta = json.loads(raw)
            name, obj, want = meta["artifact"], meta["object"], meta["artifact_sha256"]
        except (ValueError, KeyError, TypeError):
            log.warning("cache entry %s: unreadable %s; recompiling", key.digest[:12], KEY_JSON)
            return None
        if not (plain_name(name) and plain_name(obj) and isinstance(want, str)):
            log.warning(
                "cache entry %s: %s names %r / %r, not files of the entry; ignoring it",
                key.digest[:12],
                KEY_JSON,
                name,
                obj,
            )
            return None
        local = self.mirror.lookup(key)
        if local is not None and _stored_sha(local) == want:
            return local
        tmp = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.mirror.tmp))
        try:
            try:
                self.fs.get_file(f"{entry}/{obj}", str(tmp / name))
            except FileNotFoundError:
                log.warning("cache entry %s: object missing; recompiling", key.digest[:12])
                return None
            if sha256_file(tmp / name) != want:
                (tmp / name).unlink()  # (the whole directory goes below; this first)
                log.warning("cache entry %s: object damaged or half-written", key.digest[:12])
                return None
            if local is not None:  # the mirror held another compile of this key
                shutil.rmtree(local.parent, ignore_errors=True)
            extra = {k: v for k, v in meta.items() if k not in _ENTRY_FIELDS}
            return self.mirror.store(key, tmp / name, extra, link=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def store(
        self, key: CacheKey, artifact: Path, extra: JsonObject | None = None, link: bool = False
    ) -> Path:
        """Upload `artifact`, then publish its entry (key.json last). `link` has no meaning on
        an object store. A read-only cache stores nothing."""
        if self.readonly:
            return artifact
        sha = sha256_file(artifact)
        entry = self._path("entries", key.digest)
        obj = f"{sha[:16]}-{artifact.name}"
        try:
            self.fs.put_file(str(artifact), f"{entry}/{obj}")
        except Exception as exc:
            raise BuildError(f"--cache {self.url}: cannot upload {artifact.name} ({exc})") from None
        meta: dict[str, Any] = {
            "factors": key.factors,
            "artifact": artifact.name,
            "object": obj,
            "artifact_sha256": sha,
            **(extra or {}),
        }
        published = json.dumps(meta, indent=2, sort_keys=True) + "\n"
        self._write(f"{entry}/{KEY_JSON}", published.encode())  # last: the entry exists now
        return artifact

    # ------------------------------------------------------------ traces and labels

    def lookup_trace(self, key: CacheKey) -> TraceResult | None:
        """The trace stored under an early key, or None: data only, checked (traces.py)."""
        raw = self._read(self._path("traces", f"{key.digest}{TRACE_SUFFIX}"))
        return decode_trace(raw, key.digest) if raw is not None else None

    def store_trace(self, key: CacheKey, trace: TraceResult) -> None:
        if self.readonly:
            return
        self._write(self._path("traces", f"{key.digest}{TRACE_SUFFIX}"), encode_trace(trace))

    def _label_path(self, label: str) -> str:
        return self._path("labels", hashlib.sha256(label.encode()).hexdigest()[:32] + ".json")

    def previous_factors(self, label: str) -> JsonObject | None:
        raw = self._read(self._label_path(label))
        try:
            return json.loads(raw)["factors"] if raw is not None else None
        except (ValueError, KeyError, TypeError):
            return None

    def remember(self, label: str, key: CacheKey) -> None:
        if self.readonly:
            return
        data = json.dumps({"label": label, "factors": key.factors}, sort_keys=True).encode()
        self._write(self._label_path(label), data)


_ENTRY_FIELDS = ("factors", "artifact", "object", "artifact_sha256")


def _stored_sha(local: Path) -> str | None:
    try:
        return json.loads((local.parent / KEY_JSON).read_text())["artifact_sha256"]
    except (OSError, ValueError, KeyError):
        return None
