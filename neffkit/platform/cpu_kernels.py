"""neffkit's own C++ CPU kernel library: `neffkit::blocked_rows` and `blocked_rows_fp8`
(csrc/blocked_rows.cpp), `neffkit::paged_decode_attention` (csrc/decode_attention.cpp),
`neffkit::packed_rows` (csrc/packed_rows.cpp: decode rows on 4- and 8-bit weights at their
width), `neffkit::int8_rows` (csrc/int8_rows.cpp: W8A8, int8 rows times int8 weights, int32
sums through VNNI, AMX-int8 or AVX2's byte multiply-adds), `neffkit::int8_blocks`
(csrc/int8_blocks.cpp: 4- and 8-bit weights times rows quantized to int8 per block of 32
inputs, llama.cpp's arithmetic, integer sums through VNNI or AVX2), `neffkit::lora_rows`
(csrc/lora_rows.cpp: a few rows' LoRA deltas, each row through its own adapter slot).

Every kernel is written once over csrc/vec16.h's 16-lane vector: one zmm on the AVX-512 class,
two ymm on the AVX2 class (platform/isa.py), so a build compiles the library for its class.

Decode projections of a few rows on blocked weights: each weight vector is loaded once for all
rows (see the source for why Inductor's reductions do not get there). Decode attention that
reads only each row's visible keys from the paged cache, not the whole context bucket.
AOTInductor packages call the ops through the dispatcher, so a process must have the library
loaded before it runs them: a build compiles it once per source, torch version and CPU
(`$NEFFKIT_KERNEL_CACHE`, default `~/.cache/neffkit/kernels`), loads it to trace, and ships it
in the bundle (`kernels/`); the runtime loads the bundle's copy (no compiler there). A leaf:
torch only at import; the compiler is looked for only when building.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from neffkit.platform import host, isa

CSRC = Path(__file__).parent / "csrc"
ROWS_SOURCE = CSRC / "blocked_rows.cpp"  # the projections (what compile/autotune.py times)
SOURCES = (
    ROWS_SOURCE,
    CSRC / "decode_attention.cpp",
    CSRC / "packed_rows.cpp",
    CSRC / "int8_rows.cpp",
    CSRC / "int8_blocks.cpp",
    CSRC / "lora_rows.cpp",
)
LIBRARY_NAME = "libneffkit_cpu.so"
OP = "blocked_rows"
# the CPU classes (platform/isa.py) the kernels are written for: a build for another class goes
# without them (Inductor's forms)
KERNEL_CLASSES = ("avx2", "avx512")

_loaded: set[str] = set()


class KernelBuildError(RuntimeError):
    """The library could not be compiled here (no g++, a compile error)."""


def supported() -> bool:
    """Do the kernels exist for the CPU class a build here compiles for (platform/isa.py)?"""
    return isa.chosen_class() in KERNEL_CLASSES


def kernel_class() -> str | None:
    """The class the kernels are compiled for here (None: none, see `supported`)."""
    chosen = isa.chosen_class()
    return chosen if chosen in KERNEL_CLASSES else None


def is_loaded() -> bool:
    return hasattr(torch.ops, "neffkit") and hasattr(torch.ops.neffkit, OP)


def load_library(path: Path | str) -> None:
    """Register the op from a built library, once per process (a second registration of the
    same op would be refused by the dispatcher)."""
    if is_loaded() or str(path) in _loaded:
        return
    torch.ops.load_library(str(path))
    _loaded.add(str(path))


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler ({cxx}) on PATH to build {LIBRARY_NAME}")
    return cxx


def _command(cxx: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        "-O3",
        f"-march={isa.march() or 'native'}",
        "-mtune=native",
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        # no build or venv path in the library (TORCH_CHECK records __FILE__): same bytes from
        # any checkout and venv
        f"-ffile-prefix-map={CSRC}=neffkit/platform/csrc",
        f"-ffile-prefix-map={Path(torch.__file__).parent}=torch",
        *(f"-I{p}" for p in include_paths()),
        *map(str, SOURCES),
        "-o",
        str(out),
        *(f"-L{p}" for p in library_paths()),
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
    ]


def library_key(cxx: str) -> str:
    """What the compiled library depends on: source, command, torch, compiler, the CPU's ISA."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    command = " ".join(_command(cxx, Path(LIBRARY_NAME)))
    sources = [source.read_bytes().hex() for source in code_files()]
    flags = [*sorted(host.cpu_flags()), isa.requested()]
    parts = [*sources, command, torch.__version__, version, *flags]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def code_files() -> list[Path]:
    """Every file the library is compiled from: the sources and the headers they include."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "neffkit" / "kernels"
    return Path(os.environ.get("NEFFKIT_KERNEL_CACHE", default))


def build_library() -> Path:
    """The library for this host, compiled once and kept (written whole, then renamed: two
    builds at once each compile, and one rename wins). Found once per process and cache
    directory: a build asks for it at every graph's trace."""
    return _library_in(cache_dir())


@functools.cache
def _library_in(cache: Path) -> Path:
    cxx = _compiler()
    out = cache / library_key(cxx) / LIBRARY_NAME
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(_command(cxx, Path(tmp)), capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelBuildError(f"compiling {LIBRARY_NAME} failed:\n{proc.stderr[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of the cache
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def ensure_for_tracing() -> Path:
    """Build (once) and load the library, with the op's shape function for torch.export."""
    path = build_library()
    load_library(path)
    _register_fake()
    return path


@functools.cache
def _register_fake() -> None:
    torch.library.register_fake(f"neffkit::{OP}")(_blocked_rows_fake)
    torch.library.register_fake(f"neffkit::{OP}_fp8")(_blocked_rows_fp8_fake)
    torch.library.register_fake("neffkit::paged_decode_attention")(_decode_attention_fake)
    torch.library.register_fake("neffkit::packed_rows")(_packed_rows_fake)
    torch.library.register_fake("neffkit::int8_rows")(_int8_rows_fake)
    torch.library.register_fake("neffkit::int8_blocks")(_int8_blocks_fake)
    torch.library.register_fake("neffkit::lora_rows")(_lora_rows_fake)


def _lora_rows_fake(
    x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    return x.new_empty((x.shape[0], sum(t.shape[2] for t in b)))


def _blocked_rows_fake(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    outputs = sum(t.shape[0] * t.shape[2] for t in w)
    return x.new_empty((x.shape[0], outputs), dtype=torch.float32)


def _blocked_rows_fp8_fake(
    x: torch.Tensor, w: list[torch.Tensor], scales: list[torch.Tensor], k_block: int
) -> torch.Tensor:
    return _blocked_rows_fake(x, w)


def _packed_rows_fake(
    x: torch.Tensor,
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    aux: list[torch.Tensor],
    base: torch.Tensor,
    mode: int,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], sum(c.shape[0] for c in codes)), dtype=torch.float32)


def _int8_rows_fake(
    x: torch.Tensor, codes: list[torch.Tensor], scales: list[torch.Tensor]
) -> torch.Tensor:
    return x.new_empty((x.shape[0], sum(c.shape[0] for c in codes)), dtype=torch.float32)


def _int8_blocks_fake(
    x: torch.Tensor,
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    aux: list[torch.Tensor],
    bits: int,
    kind: int,
    zero: int,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], sum(c.shape[0] for c in codes)), dtype=torch.float32)


def _decode_attention_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * v_cache.shape[3]))
