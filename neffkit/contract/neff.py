"""The NEFF header: the 1024-byte block neuronx-cc prepends to a NEFF's tarball.

Layout from the Neuron runtime's "Work with NEFF files" page (`neff_header_t`, little-endian,
naturally aligned, which here needs no padding):

    u64 pkg_version, header_size, data_size, neff_version_major, neff_version_minor
    u8  neff_build_version[128]; u32 num_tpb; u8 hash[32]; u8 uuid[16]; char name[256]
    u32 requested_tpb_count; u8 tpb_per_node[64]; u64 feature_bits; u32 lnc_size; u8 pad[468]

`inspect` shows it and the loader checks it before handing a NEFF to the Neuron runtime, so an
incompatible or swapped NEFF is refused with what differs instead of failing inside libnrt.
Imports no torch and no Neuron package.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HEADER_SIZE = 1024
_FORMAT = "<5Q128sI32s16s256sI64sQI468s"
assert struct.calcsize(_FORMAT) == HEADER_SIZE


class NeffError(ValueError):
    """A file is not a NEFF, or not the NEFF a bundle expects."""


@dataclass(frozen=True)
class NeffHeader:
    pkg_version: int
    header_size: int
    data_size: int
    neff_version_major: int
    neff_version_minor: int
    build_version: str
    num_tpb: int
    hash: str  # hex
    uuid: str  # hex
    name: str
    requested_tpb_count: int
    feature_bits: int
    lnc_size: int

    @property
    def neff_version(self) -> str:
        return f"{self.neff_version_major}.{self.neff_version_minor}"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["feature_bits"] = f"0x{self.feature_bits:016x}"
        return out


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def parse_header(data: bytes, file_size: int | None = None) -> NeffHeader:
    """Parse the first 1024 bytes; `file_size` (when known) is checked against data_size."""
    if len(data) < HEADER_SIZE:
        raise NeffError(f"{len(data)} bytes is shorter than the {HEADER_SIZE}-byte NEFF header")
    fields = struct.unpack(_FORMAT, data[:HEADER_SIZE])
    (
        pkg,
        hsize,
        dsize,
        major,
        minor,
        build,
        num_tpb,
        digest,
        uuid,
        name,
        req_tpb,
        _,
        feats,
        lnc,
        _,
    ) = fields
    if hsize != HEADER_SIZE:
        raise NeffError(f"header_size is {hsize}, a NEFF header is {HEADER_SIZE} bytes")
    if file_size is not None and file_size != HEADER_SIZE + dsize:
        raise NeffError(
            f"data_size says {dsize} bytes follow the header but the file has "
            f"{file_size - HEADER_SIZE} (truncated or not a NEFF)"
        )
    return NeffHeader(
        pkg_version=pkg,
        header_size=hsize,
        data_size=dsize,
        neff_version_major=major,
        neff_version_minor=minor,
        build_version=_cstr(build),
        num_tpb=num_tpb,
        hash=digest.hex(),
        uuid=uuid.hex(),
        name=_cstr(name),
        requested_tpb_count=req_tpb,
        feature_bits=feats,
        lnc_size=lnc,
    )


def read_header(path: Path) -> NeffHeader:
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(HEADER_SIZE)
    try:
        return parse_header(head, path.stat().st_size)
    except NeffError as exc:
        raise NeffError(f"{path}: {exc}") from None


def pack_header(
    *,
    data_size: int,
    name: str,
    lnc_size: int,
    neff_version: tuple[int, int] = (2, 0),
    pkg_version: int = 2,
    build_version: str = "",
    num_tpb: int = 1,
    digest: bytes = b"",
    uuid: bytes = b"",
    requested_tpb_count: int = 1,
    feature_bits: int = 0,
) -> bytes:
    """The documented layout, for tests and tools needing a header (neuronx-cc writes real ones)."""
    return struct.pack(
        _FORMAT,
        pkg_version,
        HEADER_SIZE,
        data_size,
        neff_version[0],
        neff_version[1],
        build_version.encode(),
        num_tpb,
        digest.ljust(32, b"\0"),
        uuid.ljust(16, b"\0"),
        name.encode(),
        requested_tpb_count,
        b"",
        feature_bits,
        lnc_size,
        b"",
    )


def compatibility_problems(
    header: NeffHeader, expected: dict[str, Any], lnc: int | None = None
) -> list[str]:
    """What makes this NEFF unfit for the bundle that lists it (empty: fit).

    `expected` is the header recorded in bundle.json when the NEFF was compiled; `lnc` is the
    logical-core size the runtime will use (the manifest's `neuron.lnc`).
    """
    problems = []
    if lnc is not None and header.lnc_size not in (0, lnc):
        problems.append(f"compiled for lnc={header.lnc_size}, the runtime uses lnc={lnc}")
    recorded = {k: v for k, v in expected.items() if k in header.to_json()}
    for key, want in recorded.items():
        got = header.to_json()[key]
        if got != want:
            problems.append(f"{key} is {got!r}, the bundle recorded {want!r}")
    return problems
