"""`neffkit build --cluster`: trace and compile jobs as Ray tasks on a two-node cluster.

The cluster is Ray's own multi-node test cluster (ray.cluster_utils.Cluster: a head node and a
second node, each a raylet with one CPU, on this machine), started and stopped by the fixture.
The build runs as a separate process connecting to it, as `neffkit build` would to a real one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO


@pytest.fixture
def ray_cluster() -> Iterator[tuple[Any, Any]]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        worker = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster, worker
    finally:
        cluster.shutdown()


def _build(manifest: Path, out: Path, address: str, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "build",
        str(manifest),
        "-o",
        str(out),
        "--cluster",
        address,
        "--json",
        *extra,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )


@pytest.mark.full  # about 100 s of Ray tasks and compiles: `make test-all`
def test_cluster_build_equals_local_and_survives_a_lost_node(
    tp_bundle, session_dir, tmp_path, ray_cluster
):
    """A tp=2 build through a two-node Ray cluster writes the local build's bundle.json and ir/
    byte for byte, with tasks on both nodes; then a build whose second node is removed while
    it compiles still completes (the lost task is retried on the head node)."""
    cluster, worker = ray_cluster
    local = tp_bundle("qwen3").bundle
    manifest = session_dir / "qwen3_tp2.yaml"
    proc = _build(manifest, tmp_path / "clustered", cluster.address, "--no-cache")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out)
    assert report["counters"]["traced"] == 4 and report["counters"]["compiled"] == 2
    nodes = report["cluster_tasks_by_node"]
    assert sum(nodes.values()) == 6  # 4 traces (2 graphs x 2 ranks) + 2 compiles
    assert len(nodes) == 2  # one CPU a node: concurrent tasks ran on both
    clustered = tmp_path / "clustered"
    assert (local / "bundle.json").read_bytes() == (clustered / "bundle.json").read_bytes()
    for ir in (local / "ir").iterdir():
        assert ir.read_bytes() == (clustered / "ir" / ir.name).read_bytes()

    # the second node removed while the compile tasks run (one on each node's CPU)
    log = tmp_path / "lost.log"
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "build",
        str(manifest),
        "-o",
        str(tmp_path / "lost"),
        "--cluster",
        cluster.address,
        "--no-cache",
    ]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.time() + 600
    while "compile:" not in log.read_text() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert "compile:" in log.read_text(), log.read_text()[-3000:]
    time.sleep(2)  # both compile tasks started
    cluster.remove_node(worker)
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    assert (tmp_path / "lost" / "bundle.json").exists() and "Traceback" not in log.read_text()
