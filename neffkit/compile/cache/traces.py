"""Trace entries as data: `traces/<early key digest>.json.zst`, never a pickle.

A trace entry is what the build keeps of a trace (units.TraceResult: the canonical text, its
digest, the io-alias map, the tensor records, the source lines, the lowered HLO module): strings,
numbers and bytes, so it is stored as zstd-compressed JSON (bytes as base64) and read back with
strict, field-by-field validation. Reading one runs no code, whoever wrote the cache: a malformed
entry, one past MAX_TRACE_BYTES, or one whose canonical text or HLO module does not hash to the
digest it carries is a miss (the graph is traced again). docs/builds.md#what-must-be-trusted says
what a cache writer can still do.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Literal

import zstandard
from pydantic import BaseModel, ConfigDict, ValidationError

from neffkit.compile.units import TraceResult

log = logging.getLogger(__name__)
TRACE_SUFFIX = ".json.zst"
MAX_TRACE_BYTES = 4 << 30  # decompressed: far above any trace (a large HLO module is ~100 MB)


class _TraceEntry(BaseModel):
    """The stored form; pydantic checks every field's type (strict: no coercion)."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        ser_json_bytes="base64",
        val_json_bytes="base64",
    )
    format: Literal[1] = 1
    trace: TraceResult


def encode_trace(trace: TraceResult) -> bytes:
    text = _TraceEntry(trace=trace).model_dump_json().encode()
    return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(text)


def decode_trace(data: bytes, name: str) -> TraceResult | None:
    """The trace an entry holds, or None (logged) when it is not a sound one."""
    try:
        text = _decompress(data)
        trace = _TraceEntry.model_validate_json(text).trace
    except ValidationError as exc:
        where = ".".join(map(str, exc.errors()[0]["loc"]))
        reason = f"{where}: {exc.errors()[0]['msg']}" if where else exc.errors()[0]["msg"]
        log.warning("trace entry %s is malformed (%s); tracing again", name[:12], reason)
        return None
    except (zstandard.ZstdError, ValueError) as exc:
        log.warning("trace entry %s is unreadable (%s); tracing again", name[:12], exc)
        return None
    lowered = trace.lowered
    if hashlib.sha256(trace.canonical_text.encode()).hexdigest() != trace.graph_sha256 or (
        lowered is not None and hashlib.sha256(lowered.proto).hexdigest() != lowered.sha256
    ):
        log.warning("trace entry %s does not match its own digests; tracing again", name[:12])
        return None
    return trace


def _decompress(data: bytes) -> bytes:
    """`data` decompressed, refused past MAX_TRACE_BYTES (a small entry may claim any size)."""
    reader = zstandard.ZstdDecompressor().stream_reader(data)
    chunks, size = [], 0
    while chunk := reader.read(1 << 24):
        size += len(chunk)
        if size > MAX_TRACE_BYTES:
            raise ValueError(f"decompresses past {MAX_TRACE_BYTES:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
