"""Temp directories named after the process that owns them, so a later process can remove what
a SIGKILLed one left behind (atexit and `finally` never run after SIGKILL). The build's staging
and cache and the runtime's package loader all use it; stdlib only, so the contract holds it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(parent: Path, prefix: str) -> None:
    """Remove `<prefix><pid>-*` temp dirs whose process is gone (a SIGKILLed build or server)."""
    if not parent.is_dir():
        return
    for path in parent.glob(f"{prefix}*"):
        pid_text = path.name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def owned_temp_dir(prefix: str, parent: Path | None = None) -> Path:
    """A fresh `<prefix><pid>-*` directory under `parent` (default: the system temp dir), after
    removing the ones earlier processes left there."""
    parent = Path(parent or tempfile.gettempdir())
    remove_stale_temp_dirs(parent, prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
