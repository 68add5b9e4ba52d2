"""safetensors files read and written one tensor at a time, or mapped whole.

The build reads checkpoints with positioned reads into a fresh buffer rather than an mmap: pages
of an mmap stay mapped (and counted in the process's RSS) for as long as the file is open, so
reading a 3 GB checkpoint through one would grow the build's RSS to 3 GB; a read buffer is freed as
soon as the tensor is written. Writing lays the header out from the tensors' specs first, then
writes each tensor at its offset as it arrives: the file is a safetensors file any reader accepts,
with tensors ordered by element size (largest first, as safetensors' own writer does) so each
starts aligned to its element size. The runtime maps a bundle's shard (`map_tensors`): loading
copies nothing, and pages come in from the page cache as the first step touches them.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
NAMED_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
ALIGN = 8  # the header is padded so the data (and every aligned tensor) starts 8-byte aligned


def _read_header(f: BinaryIO) -> tuple[dict[str, dict], int]:
    """(header without `__metadata__`, offset where the data starts) of an open file."""
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def read_header(path: Path) -> dict[str, dict]:
    """The safetensors header: name → {dtype, shape, data_offsets}, `__metadata__` removed."""
    with open(path, "rb") as f:
        return _read_header(f)[0]


class TensorReader:
    """Reads one tensor at a time from a safetensors file into memory the caller owns."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.header, self.data_start = _read_header(f)
        self.fd = os.open(self.path, os.O_RDONLY)

    def get(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        buffer = bytearray(end - begin)
        view, done = memoryview(buffer), 0
        while done < len(buffer):  # preadv may return short reads on large tensors
            n = os.preadv(self.fd, [view[done:]], self.data_start + begin + done)
            if n <= 0:
                raise OSError(f"{self.path}: truncated while reading tensor {name!r}")
            done += n
        dtype = NAMED_DTYPES[entry["dtype"]]
        if not buffer:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry["shape"])

    def close(self) -> None:
        os.close(self.fd)


def tensor_nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def write_tensors(
    path: Path,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write `tensors` (yielded in `specs` order, each checked against its spec) as one
    safetensors file, holding one tensor at a time. Returns the names written, in `specs` order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offsets: dict[str, int] = {}
    offset = 0
    # largest element size first: the data starts 8-byte aligned, so every tensor is aligned
    for name, shape, dtype in sorted(specs, key=lambda s: -s[2].itemsize):
        end = offset + tensor_nbytes(shape, dtype)
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offsets[name], offset = offset, end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    data_start = 8 + len(text)
    names = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(data_start + offset)
        for (name, shape, dtype), (got, tensor) in zip(specs, tensors, strict=True):
            if got != name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(
                    f"{path}: expected {name} {tuple(shape)} {dtype}, got {got} "
                    f"{tuple(tensor.shape)} {tensor.dtype}"
                )
            if tensor.numel():
                f.seek(data_start + offsets[name])
                f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            names.append(name)
    return names


def map_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of one private (copy-on-write) mapping.

    Nothing is copied at load; the mapping lives as long as any tensor does. Writes to a tensor
    (none are expected: weights are read-only graph inputs) would stay private to the process."""
    path = Path(path)
    with open(path, "rb") as f:
        header, data_start = _read_header(f)
        if not header:
            return {}
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    out = {}
    for name, entry in header.items():
        dtype = NAMED_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if end == begin:
            out[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(
            mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data_start + begin
        )
        out[name] = flat.reshape(entry["shape"])
    return out
