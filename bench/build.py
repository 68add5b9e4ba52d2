"""Build times: cold with --jobs 1 vs --jobs 2 (parallel efficiency), warm rebuild vs cold, two
CI-matrix shards + assembly, and a Ray two-node cluster (its overhead, on one machine); with
`--large`, build memory and per-rank shard sizes on a 1.24B-parameter checkpoint.

Each cold build gets empty caches: its own artifact cache, and its own Inductor cache and kernel
library with its autotune measurements (bench/common.py `cold_env`), so that no cold build finds
what an earlier one compiled or measured; the warm rebuild reuses the --jobs 2 build's. Runs the
real CLI in subprocesses, one after another, in one invocation. `--large` makes a random
Llama-3.2-1B-shaped bf16 checkpoint (tools/make_large_model.py), builds it cold for cpu (the main
process's peak RSS per stage against its largest tensor), rebuilds it with --verify, and lowers it
at tp=8 for neuron (the largest rank shard against total / 8). Usage:

    python bench/build.py [--manifest manifests/demo.yaml]
    python bench/build.py --large
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cold_env, write_result  # noqa: E402


def timed_build(
    manifest: Path, out: Path, cache: Path | None, jobs: int, *extra: str, env: dict[str, str]
) -> tuple[float, dict]:
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "build",
        str(manifest),
        "-o",
        str(out),
        *(["--cache", str(cache)] if cache else ["--no-cache"]),
        "--jobs",
        str(jobs),
        "--json",
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True, env=env)
    return time.perf_counter() - t0, json.loads(proc.stdout)


LARGE = REPO / "bench" / "work" / "large-1b"
LARGE_MANIFEST = """neffkit: 1
name: large-1b{suffix}
model: {model}
dtype: bfloat16
{extra}
buckets: {{prefill: [128], decode: [1, 4], context: [512]}}
"""


def large() -> None:
    """Build memory at 1.24B parameters, verify on it, and per-rank shard sizes at tp=8."""
    from safetensors import safe_open

    if not (LARGE / "config.json").exists():
        tool = REPO / "tools" / "make_large_model.py"
        subprocess.run([sys.executable, str(tool), str(LARGE)], check=True, cwd=REPO)
    with safe_open(str(LARGE / "model.safetensors"), framework="pt") as f:
        sizes = {n: f.get_slice(n).get_shape() for n in f.keys()}  # noqa: SIM118
    largest = max(2 * math.prod(s) for s in sizes.values())  # bf16 bytes
    with tempfile.TemporaryDirectory(dir=REPO / "bench" / "work") as tmp:
        root = Path(tmp)
        cpu = root / "cpu.yaml"
        cpu.write_text(LARGE_MANIFEST.format(suffix="", model=LARGE, extra=""))
        env = cold_env(root / "caches")
        cold, r1 = timed_build(cpu, root / "b1", root / "cache", 2, env=env)
        verify, r2 = timed_build(cpu, root / "b2", root / "cache", 2, "--verify", env=env)
        verified = json.loads((root / "b2" / "bundle.json").read_text())["graphs"]
        shutil.rmtree(root / "b1")
        shutil.rmtree(root / "b2")
        tp8 = root / "tp8.yaml"
        extra = "target: neuron\nneuron: {target: trn2}\nparallel: {tp: 8}"
        tp8.write_text(LARGE_MANIFEST.format(suffix="-tp8", model=LARGE, extra=extra))
        lowered, r3 = timed_build(tp8, root / "b3", None, 2, "--lower-only", env=env)
        shards = sorted((root / "b3" / "weights").glob("rank*.safetensors"))
        shard_bytes = [p.stat().st_size for p in shards]
    total = (LARGE / "model.safetensors").stat().st_size
    main_peak_mb = r1["peak_rss_mb"]["main"]
    rows = {
        "model": "random Llama-3.2-1B-shaped (1.24B parameters), bfloat16, vocab 128256, tied",
        "checkpoint_bytes": total,
        "largest_tensor_bytes": largest,
        "cpu_cold_build_s": round(cold, 1),
        "cpu_main_peak_rss_mb": round(main_peak_mb, 1),
        "cpu_main_peak_rss_mb_by_stage": r1["peak_rss_mb_by_stage"],
        "cpu_workers_peak_rss_mb": round(r1["peak_rss_mb"]["workers"], 1),
        "main_peak_minus_largest_tensor_mb": round(main_peak_mb - largest / 2**20, 1),
        "verify_build_s": round(verify, 1),
        "verify_compiled": r2["counters"]["compiled"],
        "verify_ok": all(g["verify"]["ok"] for g in verified),
        "verify_main_peak_rss_mb": round(r2["peak_rss_mb"]["main"], 1),
        "tp8_lower_only_s": round(lowered, 1),
        "tp8_shard_bytes": shard_bytes,
        "tp8_largest_shard_over_total_per_rank": round(max(shard_bytes) / (total / 8), 3),
    }
    print(json.dumps(rows, indent=2))
    print(f"wrote {write_result('build_large', rows)}")


def sharded_build(manifest: Path, root: Path) -> dict[str, float | int]:
    """Two CI-matrix shards (`--shard k/2 -j 1`, run at once) into one fresh cache, then the
    assembling build: what a 2-job matrix costs on this one machine."""
    cache = root / "shard-cache"
    env = cold_env(root / "shard-caches")  # one host: the two shards share its caches
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "build",
        str(manifest),
        "--cache",
        str(cache),
        "-j",
        "1",
        "--json",
    ]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [*cmd, "--shard", f"{k}/2"], stdout=subprocess.PIPE, cwd=REPO, text=True, env=env
        )
        for k in (1, 2)
    ]
    compiled = [json.loads(p.communicate()[0])["counters"]["compiled"] for p in procs]
    wall = time.perf_counter() - t0
    assembly, report = timed_build(manifest, root / "assembled", cache, 2, env=env)
    return {
        "shards_wall_s": round(wall, 2),
        "shards_compiled": compiled,
        "assembly_s": round(assembly, 2),
        "assembly_compiled": report["counters"]["compiled"],
        "shards_total_s": round(wall + assembly, 2),
    }


def cluster_build(manifest: Path, root: Path) -> dict[str, Any]:
    """The cold build through Ray's two-node test cluster (one CPU a node, on this machine):
    on one host it can only show Ray's overhead against the local process pool."""
    from ray.cluster_utils import Cluster

    env = cold_env(root / "cluster-caches")
    started = time.perf_counter()
    # both nodes' workers, which compile, inherit it from this process as each node starts
    with patch.dict(os.environ, env):
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            up = time.perf_counter() - started
            cold, report = timed_build(
                manifest, root / "clustered", None, 2, "--cluster", cluster.address, env=env
            )
        finally:
            cluster.shutdown()
    return {
        "cluster_start_s": round(up, 2),
        "cluster_cold_s": round(cold, 2),
        "cluster_tasks_by_node": report.get("cluster_tasks_by_node", {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "demo.yaml")
    parser.add_argument("--large", action="store_true", help="the 1.24B-parameter figures")
    args = parser.parse_args()
    if args.large:
        large()
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env1, env2 = cold_env(root / "caches1"), cold_env(root / "caches2")
        cold1, r1 = timed_build(args.manifest, root / "b1", root / "cache1", 1, env=env1)
        cold2, r2 = timed_build(args.manifest, root / "b2", root / "cache2", 2, env=env2)
        warm, r3 = timed_build(args.manifest, root / "b3", root / "cache2", 2, env=env2)
        shards = sharded_build(args.manifest, root)
        cluster = cluster_build(args.manifest, root)
    graphs = r1["counters"]["graphs"]
    rows = {
        "graphs": graphs,
        "cold_jobs1_s": round(cold1, 2),
        "cold_jobs2_s": round(cold2, 2),
        "speedup_jobs2": round(cold1 / cold2, 3),
        "parallel_efficiency_jobs2": round(cold1 / cold2 / 2, 3),
        "warm_rebuild_s": round(warm, 2),
        "warm_fraction_of_cold_jobs2": round(warm / cold2, 3),
        "warm_compiled": r3["counters"]["compiled"],
        "warm_traced": r3["counters"]["traced"],
        **shards,
        "shards_fraction_of_cold_jobs2": round(shards["shards_total_s"] / cold2, 3),
        **cluster,
        "cluster_over_cold_jobs2": round(cluster["cluster_cold_s"] / cold2, 3),
        "stage_seconds": {
            "cold_jobs1": r1["seconds"],
            "cold_jobs2": r2["seconds"],
            "warm": r3["seconds"],
        },
    }
    print(f"{graphs} graphs from {args.manifest.name}")
    print(f"cold, --jobs 1 : {cold1:7.1f} s")
    print(
        f"cold, --jobs 2 : {cold2:7.1f} s   speedup {cold1 / cold2:.2f}x, "
        f"efficiency {cold1 / cold2 / 2:.0%}"
    )
    print(
        f"warm rebuild   : {warm:7.1f} s   {warm / cold2:.1%} of cold (--jobs 2), "
        f"{r3['counters']['compiled']} compiled"
    )
    print(
        f"2 shards (-j 1 each, parallel) {shards['shards_wall_s']:.1f} s + assembly "
        f"{shards['assembly_s']:.1f} s ({shards['assembly_compiled']} compiled)"
    )
    print(
        f"Ray, 2 nodes x 1 CPU: {cluster['cluster_cold_s']:.1f} s "
        f"({cluster['cluster_cold_s'] / cold2:.2f}x the local -j 2 build)"
    )
    print(f"wrote {write_result('build', {'manifest': str(args.manifest), **rows})}")


if __name__ == "__main__":
    main()
