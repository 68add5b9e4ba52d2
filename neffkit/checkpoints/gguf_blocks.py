"""GGUF's quantized blocks as neffkit's one integer layout (kernels/intquant.py), vectorized
over every block of a tensor at once (numpy), so a 262144 x 640 embedding decodes in seconds.

Each type is one `QuantScheme` whose widening is gguf-py's `dequantize`, value for value:

    Q4_0  sym  z8   g32   d * (q - 8)
    Q4_1  min       g32   d * q + m
    Q5_0  sym  z16  g32   d * (q - 16)
    Q5_1  min       g32   d * q + m
    Q8_0  sym  z128 g32   d * q          (int8 q stored as the code q + 128)
    Q4_K  min       g32   (d * sc) * q - (dmin * m)   8 sub-blocks of a 256 block
    Q5_K  min       g32   as Q4_K, 5-bit q
    Q6_K  sym  z32  g16   (d * sc) * (q - 32)         16 sub-blocks, int8 sc

The K-quants' two-level scales are multiplied out here in float32 (`d * sc`, `dmin * m`: what
gguf-py computes before it touches a code), and `x - dmin * m` is `x + (-(dmin * m))` in IEEE
arithmetic, so the widened values are gguf-py's bit for bit. Every other type (Q2_K, Q3_K,
IQ*, TQ*, ...) has no such form and is refused by name (gguf_dir.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from neffkit.checkpoints.quantized import QuantTensor
from neffkit.kernels.intquant import QuantScheme

QK_K = 256
Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes [N, block], scale, aux [N, g]


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [N, 2] → float32 [N, 1] (as gguf-py: f16 then f32)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """uint8 [N, bytes] → codes [N, 2 * bytes]: per `chunk` bytes, the low nibbles, then the
    high ones (ggml's order)."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(n, -1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """uint8 [N, 4] (a little-endian uint32) → its 32 bits, bit j at [:, j]."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(b: np.ndarray) -> Parts:
    return _nibbles(b[:, 2:], 16), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Parts:
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Parts:
    codes = _nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6]) << np.uint8(4))
    return codes, _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Parts:
    codes = _nibbles(b[:, 8:], 16) | (_bits(b[:, 4:8]) << np.uint8(4))
    return codes, _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Parts:
    return b[:, 2:] ^ np.uint8(0x80), _f16(b[:, :2]), None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (d * sc, -(dmin * m)) float32 [N, 8] from d, dmin and the 12 packed bytes
    of 6-bit sc and m (gguf-py's Q4_K.get_scale_min)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    packed = b[:, 4:16].reshape(n, 3, 4)
    lo, hi, mix = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> Parts:
    scale, aux = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scale, aux


def _q5_k(b: np.ndarray) -> Parts:
    n = b.shape[0]
    scale, aux = _k_scales(b)
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _nibbles(b[:, 48:], 32) | ((qh & np.uint8(1)).reshape(n, QK_K) << np.uint8(4))
    return codes, scale, aux


def _q6_k(b: np.ndarray) -> Parts:
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64)
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    codes = low | ((qh & np.uint8(3)).reshape(n, QK_K) << np.uint8(4))
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, _f16(b[:, 208:210]) * sc, None


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: elements and bytes per block, its scheme and its decoder."""

    block: int
    size: int
    scheme: QuantScheme
    decode: Callable[[np.ndarray], Parts]


BLOCK_TYPES = {
    "Q4_0": BlockType(32, 18, QuantScheme("sym", 4, 32, zero=8), _q4_0),
    "Q4_1": BlockType(32, 20, QuantScheme("min", 4, 32), _q4_1),
    "Q5_0": BlockType(32, 22, QuantScheme("sym", 5, 32, zero=16), _q5_0),
    "Q5_1": BlockType(32, 24, QuantScheme("min", 5, 32), _q5_1),
    "Q8_0": BlockType(32, 34, QuantScheme("sym", 8, 32, zero=128), _q8_0),
    "Q4_K": BlockType(QK_K, 144, QuantScheme("min", 4, 32), _q4_k),
    "Q5_K": BlockType(QK_K, 176, QuantScheme("min", 5, 32), _q5_k),
    "Q6_K": BlockType(QK_K, 210, QuantScheme("sym", 6, 16, zero=32), _q6_k),
}


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> QuantTensor:
    """A tensor of logical `shape` [..., rows, cols] from its stored blocks (uint8, the row's
    blocks in order: what the GGUF file holds), codes one per element."""
    kind = BLOCK_TYPES[type_name]
    *lead, cols = shape
    blocks = np.ascontiguousarray(raw).reshape(-1, kind.size)
    if blocks.shape[0] * kind.block != int(np.prod(shape)):
        raise ValueError(f"{type_name}: {raw.size} bytes do not hold a {list(shape)} tensor")
    codes, scale, aux = kind.decode(blocks)
    groups = (*lead, cols // kind.scheme.group)

    def tensor(part: np.ndarray, to: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(part).reshape(to))

    return QuantTensor(
        kind.scheme,
        tensor(codes, tuple(shape)),
        tensor(scale.astype(np.float32, copy=False), groups),
        None if aux is None else tensor(aux.astype(np.float32, copy=False), groups),
    )
