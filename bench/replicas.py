"""Data-parallel replicas against one engine on the same host: `neffkit run --data-parallel 2`
(one CPU and thread each) against one replica with every CPU's threads, streaming clients at a
fixed concurrency (bench/serve.py's load and vLLM's definitions), alternating the two servers
over rounds; and what the front's routing decision costs per request.

    python bench/replicas.py                      # SmolLM2 f32, concurrency 16, 3 rounds
    python bench/replicas.py --rounds 1 --requests-per-client 1

Writes bench/results/replicas.json; `python bench/report.py --write-docs` puts it in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, parse_args, start_server, write_result  # noqa: E402
from serve import run_level, workload  # noqa: E402

MANIFEST = REPO / "manifests" / "smollm2-serve.yaml"
BUNDLE = REPO / "bundles" / "smollm2-serve"


def routing_cost(prompts: list[list[int]], replicas: int, block_size: int) -> dict[str, float]:
    """p50 / p99 microseconds of the router's choice for each prompt (the front's own work per
    request beyond one engine's: hashing the prompt's blocks, matching each replica's)."""
    from neffkit.runtime.replicas.routing import PrefixRouter

    router = PrefixRouter(replicas, block_size)
    times = []
    for i, prompt in enumerate(prompts * 8):
        loads = [(i * 37 + r * 101) % 4096 for r in range(replicas)]
        t0 = time.perf_counter()
        router.choose(prompt, loads, None)
        times.append(1e6 * (time.perf_counter() - t0))
    ordered = sorted(times)
    return {
        "p50_us": statistics.median(ordered),
        "p99_us": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


def one_run(flags: tuple[str, ...], prompts: list[list[int]], args: argparse.Namespace) -> dict:
    proc, url = start_server(args.bundle, *flags)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        warm = asyncio.run(run_level(url, model, 2, prompts[:2], 4))  # first calls paid here
        del warm
        return asyncio.run(run_level(url, model, args.concurrency, prompts, args.output_len))
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=BUNDLE)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="replicas")
    args = parse_args(ap)
    if args.bundle == BUNDLE:
        ensure_bundle(MANIFEST, BUNDLE)
    cpus = len(os.sched_getaffinity(0))
    vocab = 49152
    prompts = workload(
        args.concurrency, args.concurrency * args.requests_per_client, args.input_len, vocab
    )
    systems = {
        f"one engine, {cpus} threads": ("--threads", str(cpus)),
        f"--data-parallel {cpus}, 1 thread each": ("--data-parallel", str(cpus)),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for r in range(args.rounds):  # alternating: the host's load drifts
        for name, flags in systems.items():
            level = one_run(flags, prompts, args)
            runs[name].append(level)
            print(
                f"round {r + 1} {name}: {level['output_tokens_per_s']:.1f} output tok/s, "
                f"TTFT median {level['ttft']['median_ms']:.0f} ms, "
                f"TPOT median {level['tpot']['median_ms']:.1f} ms"
            )
    summary = {
        name: {
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in levels),
            "ttft_median_ms": statistics.median(r["ttft"]["median_ms"] for r in levels),
            "tpot_median_ms": statistics.median(r["tpot"]["median_ms"] for r in levels),
        }
        for name, levels in runs.items()
    }
    one, dp = (summary[name]["output_tokens_per_s"] for name in systems)
    result = {
        "bundle": str(args.bundle.relative_to(REPO)),
        "cpus": cpus,
        "concurrency": args.concurrency,
        "requests": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "summary": summary,
        "data_parallel_vs_one": dp / one,
        "routing": routing_cost(prompts, cpus, 16),
        "runs": runs,
    }
    print(f"data parallel / one engine: {dp / one:.3f}; routing {result['routing']}")
    print(f"written {write_result(args.name, result)}")


if __name__ == "__main__":
    main()
