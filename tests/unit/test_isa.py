"""CPU classes (neffkit/platform/isa.py) and the engine heap's settings (platform/heap.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from neffkit.errors import BuildError
from neffkit.platform import heap, host, isa
from tests.support import REPO

ZEN3 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


def test_host_class_is_the_highest_class_the_flags_run():
    assert isa.host_class(ZEN3) == "avx2"
    assert isa.host_class(ZEN4) == "avx512"
    assert isa.host_class({"sse4_2", "avx"}) is None
    assert isa.host_class(ZEN3 - {"fma"}) is None  # AVX2 without FMA is no class


def test_native_records_this_hosts_flags(monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.requested() == "native"
    assert isa.march() is None and isa.simd_bits() is None
    assert isa.required_flags() == tuple(sorted(host.cpu_flags()))
    assert isa.chosen_class() == isa.host_class()


@pytest.mark.skipif(isa.host_class() is None, reason="needs an AVX2 host")
def test_a_lower_class_records_only_its_flags(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx2")
    assert isa.chosen_class() == "avx2"
    assert isa.march() == "x86-64-v3" and isa.simd_bits() == 256
    assert set(isa.required_flags()) == isa.CLASS_FLAGS["avx2"]


def test_unknown_and_higher_classes_are_refused(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx1024")
    with pytest.raises(BuildError, match="NEFFKIT_CPU_ISA='avx1024' is not a CPU class"):
        isa.requested()
    monkeypatch.setattr(host, "cpu_flags", lambda: ZEN3)
    monkeypatch.setenv(isa.ENV, "avx512")
    with pytest.raises(BuildError, match="above this host's \\(avx2\\)"):
        isa.requested()


PROBE = """
import sys
from neffkit.platform import heap
print(heap.pin_mmap_threshold())
heap.release_free_memory()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_mmap_threshold_is_pinned_unless_the_user_set_one():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    run = lambda e: subprocess.run(  # noqa: E731
        [sys.executable, "-c", PROBE], env=e, cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert run(env) == "True"
    assert run({**env, "MALLOC_MMAP_THRESHOLD_": "65536"}) == "False"
    assert heap.MMAP_THRESHOLD == 1 << 20


def test_bf16_on_the_avx2_class_attends_through_the_kernel_in_every_graph():
    """One sequence's prefill keeps the graph's GEMM attention, except where that GEMM is ATen's
    scalar bf16 loop (the AVX2 class): then the kernel reads it too."""
    from neffkit.models.forms import ProjectionPolicy

    native = ProjectionPolicy(max_rows=8, lanes=16, kernel="auto", attention_kernel=True)
    assert native.attends_in_kernel("decode", 1) and native.attends_in_kernel("prefill", 8)
    assert not native.attends_in_kernel("prefill", 1)
    scalar = ProjectionPolicy(
        max_rows=8, lanes=16, attention_kernel=True, prefill_attention_kernel=True
    )
    assert scalar.attends_in_kernel("prefill", 1) and scalar.attends_in_kernel("decode", 8)
    off = ProjectionPolicy(max_rows=8, lanes=16, prefill_attention_kernel=True)
    assert not off.attends_in_kernel("prefill", 1)  # no kernel library: nothing through it
