"""bundle.json's `fp8` record: which values of a bundle are fp8 and how they were scaled."""

from __future__ import annotations

from dataclasses import dataclass

from neffkit.contract.codec import Record


@dataclass(frozen=True)
class Fp8Record(Record):
    """fp8 in this bundle: which values are fp8, the range they use, the build-time rescale."""

    OMIT_NONE = True

    max: float  # the largest magnitude an fp8 value holds: 240 on trn1/trn2, else 448
    weights: str  # the checkpoint's scale layout: "block", "channel", "tensor"; "" unquantized
    weight_block: tuple[int, ...]  # its scale block [out, in] (0 spans the dimension)
    weight_rescale: float  # fp8 weights were multiplied by this at build time (240/448, or 1)
    scale_rescale: float  # and their scales by this (448/240, or 1)
    kv_cache: bool  # the KV cache is fp8
    # "checkpoint" (per-layer k_scale / v_scale), "calibrated" (measured by the build on a
    # calibration text: compile/calibrate.py), "1.0", or "" (no fp8 cache)
    kv_scales: str
    k_scales: tuple[float, ...] | None = None  # the calibrated scales, one per layer
    v_scales: tuple[float, ...] | None = None
    # how the cache stores keys (kv_cache.rotate_keys): "centered, weighted, rotated" (less a
    # calibrated offset, weighted per channel, Hadamard-rotated: kernels/kv.py); None: as is
    keys: str | None = None
