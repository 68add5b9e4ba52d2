"""Offline generation beside a busy process takes the server's thread governor (issue: default
threads collapsed offline on a shared host). The test pins the run to two CPUs and a busy loop
to one of them, and reads the governor's choice from `run --json`: it measures what the
governor decided, not how long the run took (bench/threads_offline.py has the figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_real_models import _real_bundle, smollm2  # noqa: F401 (a fixture)
from tests.support import REPO

pytestmark = pytest.mark.full


def test_offline_run_beside_a_busy_process_drops_a_thread(smollm2, session_dir):  # noqa: F811
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("the governor needs two CPUs to choose between")
    pair = f"{cpus[0]},{cpus[1]}"
    bundle = _real_bundle(session_dir, smollm2, "smollm2_tp1", 1)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NEFFKIT_ENGINE_THREADS", "OMP_NUM_THREADS")
    }
    busy = subprocess.Popen(
        ["taskset", "-c", str(cpus[0]), sys.executable, "-c", "while True: pass"]
    )
    try:
        prompt = ",".join(str(100 + i) for i in range(40))
        cmd = ["taskset", "-c", pair, sys.executable, "-m", "neffkit", "run", str(bundle)]
        cmd += ["--prompt-ids", prompt, "--max-tokens", "200", "--ignore-eos", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    finally:
        busy.kill()
        busy.wait()
    assert out.returncode == 0, out.stderr
    timings = json.loads(out.stdout)["timings"]
    assert timings["thread_reductions"] >= 1 and timings["threads"] == 1, timings
