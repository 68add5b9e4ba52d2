"""`bench/serve.py --preemption`: serving under a KV budget that forces preemption, against one
that does not.

SmolLM2-135M-Instruct (bench/lora.py's base bundle: 129 blocks of 16 tokens, decode bucket 8,
context 256), `--clients` streaming clients of `--requests-per-client` requests, prompts of
--input-len random tokens and 200 output tokens (232 tokens: 15 blocks a request at its end):
- the whole pool (128 usable blocks): 8 requests at their longest fit, nothing is preempted;
- `--num-gpu-blocks-override 49` (48 usable): 3 fit at their longest; the others are admitted
  on their prompts, run, and are preempted and recomputed as the pool runs out.
Rounds alternate between the two servers; each reports output throughput, TTFT, ITL and the
server's own vllm:num_preemptions_total.
"""

from __future__ import annotations

import asyncio
import re
import statistics
from typing import Any

import httpx
from common import start_server
from lora import bundles
from serve_lora import clients, summary

OUTPUT_LEN = 200
BUDGETS = {"whole_pool": None, "pool_48_blocks": 49}


def _preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^vllm:num_preemptions_total{[^}]*} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _one_run(url: str, args: Any) -> dict[str, float]:
    before = _preemptions(url)
    streams, wall = asyncio.run(
        clients(url, ["base"] * args.clients, args.requests_per_client, args.input_len, OUTPUT_LEN)
    )
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False)]
    return {
        **summary(streams, wall),
        "longest_gap_ms": 1000 * max(gaps),
        "preemptions": _preemptions(url) - before,
    }


def run_preemption(args: Any) -> dict[str, Any]:
    base_bundle, _ = bundles()
    servers = {}
    for key, blocks in BUDGETS.items():
        flags = ("--num-gpu-blocks-override", str(blocks)) if blocks else ()
        servers[key] = start_server(base_bundle, "--served-model-name", "base", *flags)
    rounds: dict[str, list[dict[str, float]]] = {key: [] for key in BUDGETS}
    try:
        for r in range(args.rounds):  # alternating: the host is shared
            for key, (_, url) in servers.items():
                rounds[key].append(_one_run(url, args))
                print(f"round {r} {key}: {rounds[key][-1]}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    medians = {
        key: {m: statistics.median(run[m] for run in runs) for m in runs[0]}
        for key, runs in rounds.items()
    }
    return {
        "model": "SmolLM2-135M-Instruct float32",
        "clients": args.clients,
        "requests_per_client": args.requests_per_client,
        "input_len": args.input_len,
        "output_len": OUTPUT_LEN,
        "blocks": {key: blocks or 129 for key, blocks in BUDGETS.items()},
        "block_size": 16,
        "rounds": args.rounds,
        "medians": medians,
        "runs": rounds,
        "throughput_preempting_vs_whole": medians["pool_48_blocks"]["output_tokens_per_s"]
        / medians["whole_pool"]["output_tokens_per_s"],
    }
