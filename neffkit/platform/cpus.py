"""How many CPUs this process may use, and how many threads to give the engine and the build.

`os.cpu_count()` is the host's CPUs. A process may be allowed fewer: its affinity mask (taskset,
cpusets, Kubernetes' static CPU manager) and its cgroup's CPU quota (a container limited to 2
CPUs on a 64-core host). Threads beyond those contend for the same cores, and an OpenMP pool's
threads then wait on each other at every parallel region: a decode step slows by an order of
magnitude. So the default is the smaller of the two, and a request for more than that gets a
one-line warning.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
ENV = "NEFFKIT_ENGINE_THREADS"  # the engine's threads, when --threads is not given
_warned: set[tuple[str, int]] = set()


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (the host's, where the OS has no masks)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in CPUs (quota / period), None when unlimited or unknown:
    cgroup v2's `cpu.max` ("max 100000" or "200000 100000"), else v1's cfs quota and period."""
    try:
        v2 = root / "cpu.max"
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1_quota, v1_period = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if v1_quota.exists() and v1_period.exists():
            quota_us = int(v1_quota.read_text())
            return None if quota_us <= 0 else quota_us / int(v1_period.read_text())
    except (OSError, ValueError):
        return None
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """What this process may run on at once: its affinity, capped by its cgroup's quota."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def chosen_threads(requested: int | None) -> int | None:
    """The count somebody chose: `requested` (a flag), else `NEFFKIT_ENGINE_THREADS`, else
    OpenMP's `OMP_NUM_THREADS`; None where nobody did."""
    if requested is not None:
        return requested
    for name in (ENV, "OMP_NUM_THREADS"):
        env = os.environ.get(name, "").strip()
        if env.isdigit() and int(env) > 0:
            return int(env)
    return None


def resolve_threads(requested: int | None, what: str = "engine") -> int:
    """The chosen count (chosen_threads), else the usable CPUs; asking for more than the usable
    CPUs is allowed, with one warning line on stderr."""
    usable = usable_cpus()
    requested = chosen_threads(requested)
    if requested is None:
        return usable
    if requested > usable and (what, requested) not in _warned:
        _warned.add((what, requested))
        print(
            f"neffkit: warning: {requested} {what} threads on {usable} usable CPU(s) "
            "(affinity and cgroup quota): threads will contend for cores",
            file=sys.stderr,
            flush=True,
        )
    return requested


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` for the block, the caller's count restored: for
    work whose result depends on the count (a build's kernels, a timing) inside a process whose
    engine runs with another."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
