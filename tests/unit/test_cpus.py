"""The engine's and the build's thread counts fit the CPUs a process may use: its affinity mask
and its cgroup's CPU quota (v2 `cpu.max`, v1 cfs quota and period)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neffkit.platform import cpus


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "200000 100000\n"}, 2.0),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
        ({"cpu.max": "garbage"}, None),
        ({}, None),
    ],
)
def test_cgroup_quota(tmp_path: Path, files: dict[str, str], limit: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpus.cgroup_cpu_limit(tmp_path) == limit
    usable = cpus.usable_cpus(tmp_path)
    expected = len(os.sched_getaffinity(0))
    if limit is not None:
        expected = min(expected, max(1, -(-limit // 1)))
    assert usable == expected


def test_asking_for_more_threads_than_cpus_warns_once(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    monkeypatch.delenv(cpus.ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpus.resolve_threads(None) == 2
    assert cpus.resolve_threads(2) == 2 and capsys.readouterr().err == ""
    assert cpus.resolve_threads(7) == 7 and cpus.resolve_threads(7) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "7 engine threads on 2 usable CPU(s)" in err
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # OpenMP's own choice counts as chosen
    assert cpus.chosen_threads(None) == 3
    monkeypatch.setenv(cpus.ENV, "1")
    assert cpus.resolve_threads(None) == 1


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_a_process_pinned_to_one_cpu_gets_one_thread() -> None:
    """As a container's CPU limit would: `taskset -c 0` → one engine thread by default."""
    code = "from neffkit.runtime.engine.core import engine_threads; print(engine_threads())"
    env = {k: v for k, v in os.environ.items() if k not in (cpus.ENV, "OMP_NUM_THREADS")}
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "1"


def test_a_build_runs_with_the_usable_cpus_whatever_its_caller_set() -> None:
    """Inductor writes the thread count into the kernels it generates (at 1, no parallel regions
    at all), so jobs a build runs in its own process see the usable CPUs, not the caller's
    count (an engine that ran before in the process), and the caller's count comes back."""
    import torch

    from neffkit.compile.jobs.workers import worker_pool
    from neffkit.compile.progress import Progress

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with worker_pool(1) as run:
            seen = run(torch.get_num_threads, [()], ["threads"], Progress(enabled=False))
        assert seen == [cpus.usable_cpus()]
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
