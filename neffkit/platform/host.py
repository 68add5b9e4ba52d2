"""Facts about this host that a bundle depends on.

Imports nothing heavy: both the build and the runtime use it."""

from __future__ import annotations

import platform
from pathlib import Path

# CPU features -march=native may use that matter for the code AOTInductor emits.
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


def cpu_flags() -> set[str]:
    """The ISA-relevant flags of this host's CPU (from /proc/cpuinfo on Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split()) & set(ISA_FLAGS)
    return set()


def machine() -> str:
    return platform.machine()


def cpu_description() -> str:
    """A one-line CPU description for benchmark reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
