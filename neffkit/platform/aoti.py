"""Loading AOTInductor packages without littering /tmp. A leaf: builds and the runtime use it.

`torch._C._aoti.AOTIModelPackageLoader` unpacks each package into a fresh `$TMPDIR/aotinductor_*`
directory that nothing removes (dozens pile up in /tmp after a day of runs). Here every package
a process loads unpacks into one directory of its own, removed when the process exits: the
unpacked libraries stay in use until then (CUDA kernels are read lazily), so nothing goes earlier;
what a killed process left is removed by the next one.
The loader is called directly, not through `torch._inductor`, so the runtime imports no compiler.
"""

from __future__ import annotations

import atexit
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from neffkit.contract.tempdirs import owned_temp_dir

_EXTRACTED: list[str] = []  # this process's extraction directory, once made


def extraction_dir() -> str:
    """This process's `neffkit-aoti-<pid>-*` directory; made once, after removing those of dead
    processes (a server stopped with SIGKILL runs no atexit)."""
    if not _EXTRACTED:
        _EXTRACTED.append(str(owned_temp_dir("neffkit-aoti-")))
        atexit.register(shutil.rmtree, _EXTRACTED[0], True)
    return _EXTRACTED[0]


def load_package(path: Path | str, device_index: int = -1) -> Any:
    """An AOTInductor package's runner (`.run(inputs)`, `.get_metadata()`); device_index -1: cpu."""
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = extraction_dir()  # where the C++ loader unpacks (std temp dir)
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, device_index)
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
