"""The AVX2 class's kernel library in a child process (`NEFFKIT_CPU_ISA=avx2`): the kernel
tests run their checks again there against the class's build."""

from __future__ import annotations

import re
import sys

from neffkit.platform import cpu_kernels

BUILD_FAILED_ELSEWHERE = 3  # the child's exit status: another source does not compile


def load_class_library(source: str) -> None:
    """Build and load this process's class library. Exits BUILD_FAILED_ELSEWHERE (the test
    skips) where it does not compile because of sources other than `source`, naming them."""
    try:
        path = cpu_kernels.build_library()
    except cpu_kernels.KernelBuildError as exc:
        failing = sorted(set(re.findall(r"csrc/(\w+\.(?:cpp|h)):\d+", str(exc))))
        if failing and source not in failing:
            print(f"the AVX2 class's library does not compile yet: {', '.join(failing)}")
            sys.exit(BUILD_FAILED_ELSEWHERE)
        raise
    cpu_kernels.load_library(path)
