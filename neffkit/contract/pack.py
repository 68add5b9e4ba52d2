"""A bundle as one file: `BUNDLE.tar.zst`, what CI uploads and a serving host pulls.

The pack is a tar stream, zstd-compressed: bundle.json first, then every file bundle.json lists,
in sorted order, with fixed metadata (mtime 0, root owner, mode 0644), so the same bundle always
packs to the same bytes.

A pack is untrusted until checked. Reading one streams it once into a fresh temporary directory
in the bundle cache: bundle.json first (its paths confined to the bundle, bundle.py), then each
member only if bundle.json lists it and it has not come before, hashed as it is written and
refused at its first wrong byte count or hash. Members count against `PackLimits` (their declared
sizes, their number, the free space left) before a byte of them is written; the decompressed
stream may not run past what the members declare (tar headers are read whole into memory), nor
expand more than `max_ratio` times what was read of the pack (a decompression bomb). Only a
complete, checked extraction is renamed to `<bundle cache>/<digest>` (the sha256 of bundle.json);
a later read reuses that directory only while its bundle.json still hashes to its name, and
anything else found under that name is replaced. Imports no torch (the runtime reads packs).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, cast

import zstandard

from neffkit.contract.bundle import (
    BUNDLE_JSON,
    PACK_SUFFIX,
    check_graphs_listed,
    parse_bundle_json,
    read_bundle_dir,
    sha256_file,
)
from neffkit.contract.records import BundleRecord
from neffkit.contract.tempdirs import owned_temp_dir
from neffkit.errors import BundleError

HEADER_SLACK = 1 << 20  # stream bytes allowed per member beyond its size: headers, padding


@dataclass(frozen=True)
class PackLimits:
    """What reading one pack may write (docs/builds.md#packed-bundles): a pack of a few KB can
    declare members of any size, so every member is counted before it is written."""

    max_bytes: int = 1 << 40  # the files' declared sizes together (1 TiB)
    max_files: int = 100_000  # members after bundle.json
    max_meta_bytes: int = 256 << 20  # bundle.json, read into memory
    min_free_bytes: int = 1 << 30  # kept free on the bundle cache's filesystem
    # past the first `ratio_after` bytes, the stream may expand at most `max_ratio` times the
    # compressed bytes read so far (packs of real bundles: 1.5x to 6x; zeros: thousands)
    max_ratio: int = 1000
    ratio_after: int = 256 << 20


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


class _Counted:
    """The compressed stream, counting what was read of it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.used = raw, 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.used += len(data)
        return data


class _Metered:
    """The decompressed stream, refused once it runs past what the members so far declared (tar
    reads a pax or long-name header whole into memory, whatever size it claims), or expands
    more than `limits.max_ratio` times what was read of the pack."""

    def __init__(self, compressed: _Counted, limits: PackLimits, pack: str) -> None:
        self.compressed, self.limits, self.pack = compressed, limits, pack
        self.reader = zstandard.ZstdDecompressor().stream_reader(cast(IO[bytes], compressed))
        self.allowed, self.used = limits.max_meta_bytes + HEADER_SLACK, 0

    def allow(self, size: int) -> None:
        self.allowed += size + HEADER_SLACK

    def read(self, size: int = -1) -> bytes:
        room = self.allowed - self.used + 1
        data = self.reader.read(room if size < 0 else min(size, room))
        self.used += len(data)
        if self.used > self.allowed:
            raise BundleError(
                f"{self.pack}: the pack's stream runs past what its members declare (over "
                f"{self.allowed:,} bytes: an oversized tar header)",
                hint="this pack was not written by `neffkit build --pack`; do not use it",
            )
        ratio = self.limits.max_ratio
        if self.used > self.limits.ratio_after + ratio * self.compressed.used:
            raise BundleError(
                f"{self.pack}: expands more than {ratio:,} times ({self.compressed.used:,} bytes "
                f"of pack gave {self.used:,}): a decompression bomb, not a bundle",
                hint="this pack was not written by `neffkit build --pack`; do not use it",
            )
        return data


def unpack_bundle(pack: Path | str, limits: PackLimits | None = None) -> Path:
    """The directory holding the pack's bundle (a local path or an fsspec URL), extracted
    (once) and every file checked, within `limits` (default: PackLimits())."""
    limits = limits or PackLimits()
    cache = bundle_cache()
    cache.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        with _open_pack(pack) as raw:
            metered = _Metered(_Counted(raw), limits, str(pack))
            with tarfile.open(fileobj=cast(IO[bytes], metered), mode="r|") as tar:
                meta, record = _read_meta(tar, pack, limits)
                dest = cache / hashlib.sha256(meta).hexdigest()
                if _extracted(dest):
                    return dest  # extracted and checked before, and bundle.json is unchanged
                tmp = owned_temp_dir(".unpack-", cache)
                (tmp / BUNDLE_JSON).write_bytes(meta)
                _extract(tar, metered, record, tmp, str(pack), limits)
        check_graphs_listed(record, str(pack))
        _publish(tmp, dest)
    except (zstandard.ZstdError, tarfile.TarError, EOFError, OSError) as exc:
        raise BundleError(
            f"{pack}: truncated or damaged pack ({exc})", hint="download or copy it again"
        ) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _read_meta(
    tar: tarfile.TarFile, pack: Path | str, limits: PackLimits
) -> tuple[bytes, BundleRecord]:
    """The first member, bundle.json: its bytes and its record (format and paths checked)."""
    first = tar.next()
    if first is None or first.name != BUNDLE_JSON or not first.isfile():
        raise BundleError(f"{pack}: not a bundle pack ({BUNDLE_JSON} must come first)")
    if first.size > limits.max_meta_bytes:
        raise BundleError(
            f"{pack}: its {BUNDLE_JSON} declares {first.size:,} bytes, over the "
            f"{limits.max_meta_bytes:,} a bundle.json may have",
            hint="this pack was not written by `neffkit build --pack`; do not use it",
        )
    meta = tar.extractfile(first).read()  # type: ignore[union-attr]
    return meta, parse_bundle_json(meta, f"{pack}/{BUNDLE_JSON}")


def _extract(
    tar: tarfile.TarFile,
    metered: _Metered,
    record: BundleRecord,
    tmp: Path,
    pack: str,
    limits: PackLimits,
) -> None:
    """Every member after bundle.json into `tmp`, each listed once, counted against `limits`
    before it is written and hashed as it is; then every listed file is there."""
    files, total = record.files, 0
    seen: set[str] = set()
    while (member := tar.next()) is not None:  # stream: forward only
        name = member.name
        if name == BUNDLE_JSON or name in seen:
            raise BundleError(
                f"{pack}: member {name!r} appears twice",
                hint="a pack holds each file once; this one was altered: do not use it",
            )
        if not member.isfile():
            raise BundleError(f"{pack}: member {name!r} is not a file")
        if name not in files:
            raise BundleError(f"{pack}: files not in its bundle.json: {name}")
        if len(seen) >= limits.max_files:
            raise BundleError(f"{pack}: more than {limits.max_files:,} files")
        total += member.size
        if total > limits.max_bytes:
            raise BundleError(
                f"{pack}: its files declare more than {limits.max_bytes:,} bytes (at {name})",
                hint="a pack may expand to 1 TiB at most (docs/builds.md#packed-bundles)",
            )
        _check_room(tmp, name, member.size, limits, pack)
        metered.allow(member.size)
        seen.add(name)
        _write_member(tar.extractfile(member), tmp / name, files[name], f"{pack}: file {name}")
    missing = sorted(set(files) - seen)
    if missing:
        raise BundleError(
            f"{pack}: file {missing[0]} is missing ({len(missing)} listed files are)",
            hint="download or copy it again",
        )


def _check_room(tmp: Path, name: str, size: int, limits: PackLimits, pack: str) -> None:
    free = shutil.disk_usage(tmp).free
    if size > free - limits.min_free_bytes:
        raise BundleError(
            f"{pack}: {name} ({size:,} bytes) does not fit in the bundle cache {tmp.parent} "
            f"({free:,} bytes free, {limits.min_free_bytes:,} kept free)",
            hint="free space there, or point $NEFFKIT_BUNDLES at a larger disk",
        )


def _write_member(src: IO[bytes] | None, target: Path, want: str, what: str) -> None:
    """Copy one member to `target` (a new file), hashing it; a wrong hash is refused."""
    if src is None:  # tarfile gives every regular member a reader: never expected here
        raise BundleError(f"{what} cannot be read from the pack")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with target.open("xb") as out:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != want:
        raise BundleError(
            f"{what} is corrupt (sha256 {digest.hexdigest()[:12]}…, expected {want[:12]}…)",
            hint="the pack was modified or damaged in transit; download or copy it again",
        )


def _extracted(dest: Path) -> bool:
    """`dest` is an extraction whose bundle.json still hashes to its name (its files were
    checked against that bundle.json when it was renamed there; readers check them again)."""
    meta = dest / BUNDLE_JSON
    try:
        if dest.is_symlink() or meta.is_symlink() or not meta.is_file():
            return False
        return sha256_file(meta) == dest.name
    except OSError:
        return False


def _publish(tmp: Path, dest: Path) -> None:
    """Rename the checked extraction onto `dest`. A good one another process renamed there
    first is kept; anything else under that name (an altered or stale directory) is removed."""
    if _extracted(dest):
        return
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    elif dest.exists():
        aside = owned_temp_dir(".stale-", dest.parent)
        os.rename(dest, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process renamed its extraction there meanwhile
        if not _extracted(dest):
            raise
