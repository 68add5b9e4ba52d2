"""`bench/serve.py --adapters`: the server with adapters, against the same server without.

Three runs on SmolLM2-135M-Instruct (bench/lora.py's bundles and rank-16 adapters), each
`--clients` streaming clients of `--requests-per-client` requests:
- the base bundle, every request to the base;
- the bundle with 4 adapter slots, served with `--lora-modules` of the 4 adapters, each client
  naming its own (clients % 4): a decode batch of 8 mixes 4 distinct adapters;
- the same bundle and clients on the base (3 adapters served), one long request each, while
  another loads the fourth through `POST /v1/load_lora_adapter` (and unloads it) five times
  once they all decode: each load's wall time, and the longest gap between two streamed tokens
  of any request during it, against the median gap (a step), the longest gap in same-length
  windows between loads, and the p99 gap outside the loads.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

import httpx
from common import start_server
from lora import adapters, bundles

Stream = list[float]  # the times a request's tokens arrived


async def stream(
    http: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int
) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    stamps: Stream = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices"):
                    stamps.append(time.perf_counter())
    return stamps


async def clients(url: str, models: list[str], per_client: int, in_len: int, out_len: int) -> Any:
    """Every client's requests one after another, the clients at once; (streams, wall time)."""
    rng = random.Random(0)
    done: list[Stream] = []

    async def client(model: str) -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            for _ in range(per_client):
                prompt = [rng.randrange(3, 40000) for _ in range(in_len)]
                done.append(await stream(http, url, model, prompt, out_len))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(m) for m in models))
    return done, time.perf_counter() - t0


def summary(streams: list[Stream], wall: float) -> dict[str, float]:
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False)]
    tokens = sum(len(s) for s in streams)
    return {
        "output_tokens_per_s": tokens / wall,
        "itl_median_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * sorted(gaps)[int(0.99 * (len(gaps) - 1))],
    }


LOADS = 5  # load + unload cycles while the clients decode
SPACING_S = 0.6  # between two loads; a control window sits halfway between


def _longest(pairs: list[tuple[float, float]], start: float, end: float) -> float:
    """The longest gap between two streamed tokens that overlaps [start, end]."""
    return max((b - a for a, b in pairs if b > start and a < end), default=0.0)


async def load_during(url: str, models: list[str], args: Any, path: str) -> dict[str, float]:
    """The base clients, and LOADS loads (each unloaded again) of the adapter at `path` once
    they are decoding: each load's wall time and the longest gap between two tokens of any
    request during it, against the same-length windows halfway between loads (what the host
    does with no load) and the median gap (a step)."""

    async def loads() -> list[tuple[float, float]]:
        await asyncio.sleep(1.0)  # every client's first request decoding
        spans = []
        async with httpx.AsyncClient(timeout=600) as http:
            for i in range(LOADS):
                t0 = time.perf_counter()
                body = {"lora_name": f"loaded{i}", "lora_path": path}
                resp = await http.post(f"{url}/v1/load_lora_adapter", json=body)
                resp.raise_for_status()
                spans.append((t0, time.perf_counter()))
                await http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": f"loaded{i}"})
                await asyncio.sleep(SPACING_S)
        return spans

    # one long request a client: every row decodes while the loads run (no prefill between)
    run = clients(url, models, 1, args.input_len, 3 * args.output_len)  # within 256 tokens
    (streams, wall), spans = await asyncio.gather(run, loads())
    pairs = [(a, b) for s in streams for a, b in zip(s, s[1:], strict=False)]
    during = [_longest(pairs, start, end) for start, end in spans]
    half = SPACING_S / 2
    control = [_longest(pairs, end + half, 2 * end - start + half) for start, end in spans]
    outside = sorted(b - a for a, b in pairs if not any(b > s and a < e for s, e in spans))
    median_gap = statistics.median(outside)
    return {
        **summary(streams, wall),
        "loads": LOADS,
        "load_ms": 1000 * statistics.median(e - s for s, e in spans),
        "longest_gap_during_load_ms": 1000 * max(during),
        "longest_gap_during_load_median_ms": 1000 * statistics.median(during),
        "longest_gap_in_control_windows_median_ms": 1000 * statistics.median(control),
        "median_gap_ms": 1000 * median_gap,
        "p99_gap_outside_load_ms": 1000 * outside[int(0.99 * (len(outside) - 1))],
        "stall_added_median_ms": 1000 * (statistics.median(during) - median_gap),
    }


def run_adapters(args: Any) -> dict[str, Any]:
    base_bundle, lora_bundle = bundles()
    paths = adapters()
    modules = [f"a{i}={p}" for i, p in enumerate(paths)]
    served = [f"a{i % len(paths)}" for i in range(args.clients)]
    result: dict[str, Any] = {"clients": args.clients, "adapters": len(paths)}
    os.environ["NEFFKIT_ALLOW_RUNTIME_LORA_UPDATING"] = "true"  # the servers inherit it
    runs = [
        ("base", base_bundle, (), None),
        ("adapters", lora_bundle, ("--lora-modules", *modules), served),
        ("load_during_base", lora_bundle, ("--lora-modules", *modules[:-1]), None),
    ]
    for key, bundle, flags, names in runs:
        proc, url = start_server(bundle, "--served-model-name", "base", *flags)
        try:
            models = names or ["base"] * args.clients
            if key == "load_during_base":
                result[key] = asyncio.run(load_during(url, models, args, str(paths[-1])))
            else:
                streams, wall = asyncio.run(
                    clients(url, models, args.requests_per_client, args.input_len, args.output_len)
                )
                result[key] = summary(streams, wall)
        finally:
            proc.terminate()
            proc.wait()
        print(f"{key}: {result[key]}")
    result["itl_adapters_vs_base"] = (
        result["adapters"]["itl_median_ms"] / result["base"]["itl_median_ms"]
    )
    return result
