"""An engine's heap hands its transients back to the OS.

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB); after that, a
step's transient buffers (the prefill form's widened weights, activations) are carved from the
heap and stay resident once freed. On a 4-bit SmolLM2 that left ~20 MiB above weights + KV, a
quarter of the weights. Pinning the threshold keeps blocks of 1 MiB and more in mappings of
their own, returned on free; a trim after loading returns what the load left free.

A user's own `MALLOC_MMAP_THRESHOLD_` wins; on a libc without `mallopt` both calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    return libc


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks of `nbytes` and more from their own mappings, whatever is freed later.
    False: not done (no glibc, or the user set the threshold)."""
    libc = _libc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))


def release_free_memory() -> None:
    """Return the heap's free pages to the OS (after a load: its staging buffers)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(ctypes.c_size_t(0))
