"""The CPU class a cpu build compiles for: its kernels' instruction set and Inductor's -march.

Classes, lowest first:
- `avx2`: AVX2 + FMA + F16C (Intel Haswell on, AMD Zen 1-3): 256-bit vectors, 16 registers.
- `avx512`: AVX-512 F/BW/VL/DQ (Intel Skylake-SP on, AMD Zen 4 on): 512-bit vectors, 32
  registers; AVX512-BF16, VNNI and AMX where the host has them.

A build compiles for its host (`native`: `-march=native`, the host's own class) unless
`$NEFFKIT_CPU_ISA` names a lower class: a bundle for an AVX2 fleet built in CI on an AVX-512
host. The bundle then records only that class's flags, which is what the loader asks of a host.
"""

from __future__ import annotations

import os

from neffkit.errors import BuildError
from neffkit.platform import host

ENV = "NEFFKIT_CPU_ISA"
# what each class needs of a host, lowest first (host.ISA_FLAGS names)
CLASS_FLAGS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl"}),
}
# the -march of a class built for below its host (x86-64-v3: AVX2, FMA, F16C, BMI1/2, MOVBE)
CLASS_MARCH = {"avx2": "x86-64-v3", "avx512": "x86-64-v4"}
CLASS_SIMD_BITS = {"avx2": 256, "avx512": 512}


def host_class(flags: set[str] | None = None) -> str | None:
    """The highest class this host's CPU runs (None: below AVX2, or not x86)."""
    flags = host.cpu_flags() if flags is None else flags
    runs = [name for name, need in CLASS_FLAGS.items() if need <= flags]
    return runs[-1] if runs else None


def requested() -> str:
    """`native` or the class `$NEFFKIT_CPU_ISA` names (checked: one this host runs)."""
    asked = os.environ.get(ENV, "native").strip() or "native"
    if asked == "native":
        return asked
    if asked not in CLASS_FLAGS:
        raise BuildError(
            f"${ENV}={asked!r} is not a CPU class",
            hint=f"one of native, {', '.join(CLASS_FLAGS)}",
        )
    mine = host_class()
    if mine is None or list(CLASS_FLAGS).index(asked) > list(CLASS_FLAGS).index(mine):
        raise BuildError(
            f"${ENV}={asked} asks for a class above this host's ({mine or 'below avx2'}): "
            "its kernels could not be tuned or checked here",
            hint="build on a host of that class, or unset it",
        )
    return asked


def chosen_class() -> str | None:
    """The class a build here compiles for (None: this host runs no class's kernels)."""
    asked = requested()
    return host_class() if asked == "native" else asked


def march() -> str | None:
    """-march for the kernels and Inductor's code: None is the compilers' `native`."""
    asked = requested()
    return None if asked == "native" else CLASS_MARCH[asked]


def simd_bits() -> int | None:
    """Inductor's vector width for a lower class (None: Inductor picks the host's)."""
    asked = requested()
    return None if asked == "native" else CLASS_SIMD_BITS[asked]


def required_flags() -> tuple[str, ...]:
    """The CPU flags a bundle built here needs of a host: this host's (native), or the class's."""
    asked = requested()
    flags = host.cpu_flags() if asked == "native" else CLASS_FLAGS[asked]
    return tuple(sorted(flags))
