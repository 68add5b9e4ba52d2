"""`neffkit run BUNDLE --ray-address ADDR --data-parallel 2`: the replicas as a Ray Serve
application on a two-node Ray cluster (ray.cluster_utils.Cluster: two raylets of one CPU on this
machine, started and stopped here), driven through the OpenAI routes by real clients."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import REPO
from tests.support.replicas import complete_all, per_engine
from tests.support.server import Server

pytestmark = [pytest.mark.xdist_group("ray_serve"), pytest.mark.full]

PROMPTS = [[(5 * i + j) % 900 + 3 for j in range(4 + i % 9)] for i in range(8)]
SHARED = list(range(200, 232))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(serve_bundle: Path) -> Iterator[str]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    port, logs = _port(), Path(tempfile.mkdtemp(prefix="neffkit-ray-"))
    proc = None
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        cmd = [sys.executable, "-m", "neffkit", "run", str(serve_bundle), "--port", str(port)]
        cmd += ["--ray-address", cluster.address, "--data-parallel", "2"]
        cmd += ["--served-model-name", "tiny"]
        with (logs / "out").open("w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (logs / "out").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError("the Ray Serve application did not become healthy")
        complete_all(url, PROMPTS[:1])  # the front's handle has learnt both replicas after
        time.sleep(2)
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
        cluster.shutdown()


def test_ray_replicas_equal_one_engine_and_follow_prefixes(ray_server, server: Server):
    assert complete_all(ray_server, PROMPTS) == complete_all(server.url, PROMPTS)
    time.sleep(2.5)  # the replicas post their metrics each second
    success = per_engine(ray_server, "vllm:request_success_total")
    assert len(success) == 2 and sum(success.values()) >= len(PROMPTS), success
    hits_before = per_engine(ray_server, "vllm:prefix_cache_hits_total")
    complete_all(ray_server, [[*SHARED, 7, 8, 9]])
    tails = [[*SHARED, 11 + i, 40 + i, 70 + i] for i in range(6)]
    for tail in tails:  # one at a time: each finds the prefix where the first left it
        complete_all(ray_server, [tail])
    time.sleep(2.5)
    hits = per_engine(ray_server, "vllm:prefix_cache_hits_total")
    gained = max(hits[e] - hits_before.get(e, 0) for e in hits)
    assert gained >= 0.8 * len(SHARED) * len(tails), (hits_before, hits)


def _replica_cores() -> list[int]:
    """The engine cores Ray's engine replicas started (children of `EngineReplica` workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent_cmd = Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if b"spawn_main" in cmdline and b"EngineReplica" in parent_cmd:
            pids.append(int(proc.name))
    return pids


def test_a_killed_engine_is_replaced_by_ray(ray_server):
    cores = _replica_cores()
    assert len(cores) == 2, cores
    os.kill(cores[0], signal.SIGKILL)
    time.sleep(3)  # the replica ends with its engine; Ray routes around it
    complete_all(ray_server, PROMPTS)  # every one a 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = [p for p in _replica_cores() if p != cores[0]]
        if len(now) == 2:
            break
        time.sleep(1)
    assert len(now) == 2, "no replacement within 60 s"
    assert complete_all(ray_server, PROMPTS) == complete_all(ray_server, PROMPTS)
