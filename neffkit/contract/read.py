"""Open a bundle wherever it lies: a directory, or a pack (BUNDLE.tar.zst) that is extracted once
into the bundle cache with every file checked (pack.py)."""

from __future__ import annotations

from pathlib import Path

from neffkit.contract.bundle import Bundle, is_pack, read_bundle_dir
from neffkit.contract.pack import PackLimits, unpack_bundle


def read_bundle(path: str | Path, verify: bool = True, limits: PackLimits | None = None) -> Bundle:
    """Open a bundle directory or a packed bundle; check its format, its paths and (by default)
    every file's sha256. `limits`: what extracting a pack may write (default PackLimits())."""
    root = Path(path)
    if is_pack(root):
        root = unpack_bundle(root, limits)
    return read_bundle_dir(root, verify)
