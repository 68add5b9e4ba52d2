"""A bundle as one file: `BUNDLE.tar.zst`, what CI uploads and a serving host pulls.

The pack is a tar stream, zstd-compressed: bundle.json first, then every file bundle.json lists,
in sorted order, with fixed metadata (mtime 0, root owner, mode 0644), so the same bundle always
packs to the same bytes. Reading a pack streams it once into a directory keyed by the bundle's
digest (the sha256 of its bundle.json) under the bundle cache, checks every file's hash there,
and renames it into place; a later read of the same bundle uses that directory. A truncated or
altered pack is refused with the reason, and nothing half-extracted is ever used. Imports no
torch (the runtime reads packs).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import zstandard

from neffkit.contract.bundle import BUNDLE_JSON, PACK_SUFFIX, read_bundle_dir
from neffkit.errors import BundleError


def bundle_cache() -> Path:
    """Where packs are extracted: $NEFFKIT_BUNDLES, else ~/.cache/neffkit/bundles."""
    if os.environ.get("NEFFKIT_BUNDLES"):
        return Path(os.environ["NEFFKIT_BUNDLES"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "neffkit" / "bundles"


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o644, 0, 0
    info.uname = info.gname = ""
    return info


def pack_bundle(root: Path, out: Path | None = None) -> Path:
    """Write `root` (a bundle directory, already verified by its builder) as ROOT.tar.zst beside
    it, atomically (a temporary file renamed at the end)."""
    bundle = read_bundle_dir(root, verify=False)
    out = out or root.with_name(root.name + PACK_SUFFIX)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            writer = zstandard.ZstdCompressor(level=10).stream_writer(raw, closefd=False)
            with writer, tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for rel in [BUNDLE_JSON, *sorted(bundle.record.files)]:
                    path = root / rel
                    with path.open("rb") as f:
                        tar.addfile(_member(rel, path.stat().st_size), f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _safe(name: str) -> str:
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or ".." in parts:
        raise BundleError(f"pack member {name!r} would be written outside the bundle")
    return name


def _open_pack(pack: Path | str) -> BinaryIO:
    """A local pack, or one at an fsspec URL (s3://…, gs://…, https://…), read as a stream."""
    if isinstance(pack, Path) or "://" not in pack:
        return Path(pack).open("rb")
    if not pack.endswith(PACK_SUFFIX):
        raise BundleError(f"{pack}: a bundle at a URL must be a pack (BUNDLE{PACK_SUFFIX})")
    try:
        import fsspec

        return fsspec.open(pack, "rb").open()
    except ImportError as exc:
        raise BundleError(
            f"{pack}: {exc}", hint="install the protocol's fsspec package (s3fs, gcsfs)"
        ) from None
    except FileNotFoundError:
        raise BundleError(f"{pack}: no such pack") from None
    except Exception as exc:  # credentials, endpoint, bucket
        raise BundleError(f"{pack}: cannot read it ({type(exc).__name__}: {exc})") from None


def unpack_bundle(pack: Path | str) -> Path:
    """The directory holding the pack's bundle (a local path or an fsspec URL), extracted
    (once) and every file checked."""
    cache = bundle_cache()
    cache.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        with _open_pack(pack) as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                first = tar.next()
                if first is None or first.name != BUNDLE_JSON or not first.isfile():
                    raise BundleError(f"{pack}: not a bundle pack ({BUNDLE_JSON} must come first)")
                meta = tar.extractfile(first).read()  # type: ignore[union-attr]
                dest = cache / hashlib.sha256(meta).hexdigest()
                if (dest / BUNDLE_JSON).is_file():
                    return dest  # extracted (and checked) before
                tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=cache))
                (tmp / BUNDLE_JSON).write_bytes(meta)
                while (member := tar.next()) is not None:  # stream: forward only
                    if not member.isfile():
                        raise BundleError(f"{pack}: member {member.name!r} is not a file")
                    target = tmp / _safe(member.name)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with target.open("wb") as out:
                        shutil.copyfileobj(tar.extractfile(member), out, 1 << 20)  # type: ignore[arg-type]
    except (zstandard.ZstdError, tarfile.TarError, EOFError, OSError) as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise BundleError(
            f"{pack}: truncated or damaged pack ({exc})", hint="download or copy it again"
        ) from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert tmp is not None
    try:
        try:
            bundle = read_bundle_dir(tmp, verify=True)  # every listed file, with its hash
        except BundleError as exc:  # name the pack, not the temporary directory
            message = exc.message.replace(str(tmp), "").lstrip(": ")
            raise BundleError(f"{pack}: {message}", hint="download or copy it again") from None
        extra = sorted(
            p.relative_to(tmp).as_posix()
            for p in tmp.rglob("*")
            if p.is_file() and p.name != BUNDLE_JSON
        )
        unlisted = sorted(set(extra) - set(bundle.record.files))
        if unlisted:
            raise BundleError(f"{pack}: files not in its bundle.json: {', '.join(unlisted)}")
        try:
            tmp.rename(dest)
        except OSError:  # another process extracted the same bundle first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
