"""Per-token decode latency at tp=1 vs tp=2 on one machine, and the share spent in collectives.

Builds tp=1 and tp=2 bundles of the demo model (once), times batch-1 decode steps of each (host
work included), and estimates the collective share at tp=2 from a gloo all-reduce microbenchmark
of the same tensor size on two processes: (all-reduces per step x time per all-reduce) / step time.
Usage:  python bench/tp.py [--steps 64]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, decode_step_times, ensure_bundle, median, parse_args, write_result  # noqa: E402

from neffkit.runtime.engine.core import EngineCore  # noqa: E402
from neffkit.runtime.engine.loading import load  # noqa: E402

BUCKETS = {"prefill": [32], "decode": [1], "context": [256]}
ALL_REDUCE_BENCH = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
x = torch.zeros(1, 1, int(sys.argv[1]))
for _ in range(200): dist.all_reduce(x)
n = int(sys.argv[2]); t0 = time.perf_counter()
for _ in range(n): dist.all_reduce(x)
if dist.get_rank() == 0: print((time.perf_counter() - t0) / n)
dist.destroy_process_group()
"""


def manifest_for(tp: int, out_dir: Path) -> Path:
    path = out_dir / f"demo-tp{tp}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "neffkit": 1,
                "name": f"demo-tp{tp}",
                "model": str(REPO / "models" / "demo-llama"),
                "parallel": {"tp": tp},
                "kv_cache": {"block_size": 16},
                "buckets": BUCKETS,
            }
        )
    )
    return path


def all_reduce_seconds(hidden: int, iters: int = 2000) -> float:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29671", "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-c", ALL_REDUCE_BENCH, str(hidden), str(iters)]
    peer = subprocess.Popen(cmd, env={**env, "RANK": "1"})
    out = subprocess.run(cmd, env={**env, "RANK": "0"}, capture_output=True, text=True, check=True)
    peer.wait()
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parse_args(parser)
    bundles = REPO / "bundles"
    bundles.mkdir(exist_ok=True)
    tp1 = ensure_bundle(manifest_for(1, bundles), bundles / "demo-tp1")
    tp2 = ensure_bundle(manifest_for(2, bundles), bundles / "demo-tp2")

    engine = EngineCore(load(tp1).runner)
    t1 = [
        t
        for _ in range(args.rounds)
        for t in decode_step_times(engine, [list(range(1, 17))], args.steps)
    ]

    from neffkit.runtime.worker.distributed import run_ranks

    t2 = run_ranks(
        tp2,
        2,
        lambda loaded: [
            t
            for _ in range(args.rounds)
            for t in decode_step_times(EngineCore(loaded.runner), [list(range(1, 17))], args.steps)
        ],
    )
    model = load(tp1, verify=False).bundle.record.model.config
    per_call = all_reduce_seconds(model["hidden_size"])
    reduces = 2 * model["num_layers"]
    ms1, ms2 = 1000 * median(t1), 1000 * median(t2)
    share = reduces * per_call * 1000 / ms2
    print(
        f"decode, batch 1, demo model ({model['num_layers']} layers, hidden "
        f"{model['hidden_size']}), median of {len(t1)} steps"
    )
    print(f"tp=1: {ms1:.3f} ms/token   tp=2: {ms2:.3f} ms/token   tp2/tp1: {ms2 / ms1:.2f}x")
    print(
        f"gloo all-reduce [1,1,{model['hidden_size']}]: {per_call * 1e6:.1f} us; "
        f"{reduces} per step = {reduces * per_call * 1000:.3f} ms = {share:.0%} of a tp=2 step"
    )
    path = write_result(
        "tp",
        {
            "tp1_ms_per_token": ms1,
            "tp2_ms_per_token": ms2,
            "tp2_over_tp1": ms2 / ms1,
            "all_reduce_us": per_call * 1e6,
            "all_reduces_per_step": reduces,
            "collective_share_tp2": share,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
