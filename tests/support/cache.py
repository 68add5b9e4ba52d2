"""The persistent test cache (docs/testing.md):

$NEFFKIT_TEST_CACHE (default ~/.cache/neffkit-test)
  models/<kind>-<digest>/   the test checkpoints, made once per machine; the digest covers
                            everything a checkpoint is made from (config, seed, transformers,
                            the code in tests/support/models.py), so a changed recipe makes a
                            new one
  artifacts/                neffkit's own artifact cache (compiled graphs, traces, weight
                            shards), keyed by the product's cache keys: an unchanged graph is
                            never compiled twice on one machine
  bundles/                  the test bundles (tests/support/bundles.py)
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.progress import note


def cache_root() -> Path:
    """The persistent test cache: $NEFFKIT_TEST_CACHE, else ~/.cache/neffkit-test."""
    configured = os.environ.get("NEFFKIT_TEST_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "neffkit-test"


def artifact_cache() -> Path:
    """neffkit's artifact cache inside the test cache: every test build reads and fills it. One
    per compile environment, so the tests that compare fresh compiles with cached ones compare
    bytes made alike."""
    return cache_root() / "artifacts" / environment_digest()


@contextmanager
def exclusive(session_dir: Path, name: str) -> Iterator[None]:
    """Hold the run-wide lock `name`: one worker makes a shared thing, the others wait for it."""
    locks = session_dir / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_dir(name: str, make: Callable[[Path], object]) -> Path:
    """cache_root()/NAME, made once per machine by `make(tmp)` and renamed into place, so an
    interrupted run never leaves half a checkpoint behind and concurrent runs agree."""
    out = cache_root() / name
    if (out / ".complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(cache_root(), name.replace("/", "-")):
        if not (out / ".complete").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            t0 = time.monotonic()
            note(f"making {name} (not in the test cache: new, or what makes it changed)")
            try:
                try:
                    make(tmp)
                except BaseException:
                    note(f"made {name}: failed after {time.monotonic() - t0:.0f} s")
                    raise
                note(f"made {name} in {time.monotonic() - t0:.0f} s")
                (tmp / ".complete").write_text("")
                shutil.rmtree(out, ignore_errors=True)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


@functools.cache
def _compiler_version() -> str:
    proc = subprocess.run(["c++", "--version"], capture_output=True, text=True)
    return proc.stdout.splitlines()[0] if proc.returncode == 0 and proc.stdout else "none"


@functools.cache
def environment_digest() -> str:
    """What an artifact's bytes depend on beyond its graph (docs/builds.md, reproducible
    packages): the host the product's own cache keys by, the C++ compiler, and the paths the
    compiled library records (torch's headers, Inductor's cache directory). A test cache carried
    to another machine or venv then builds its bundles again instead of comparing old bytes."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from neffkit.compile.backends import get_backend

    host = get_backend("cpu").host_requirements().to_json()
    env = [host, _compiler_version(), str(Path(torch.__file__).parent), cache_dir()]
    return hashlib.sha256(json.dumps(env).encode()).hexdigest()[:16]
