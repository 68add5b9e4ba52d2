"""`bench/serve.py --adapters`: the server with adapters, against the same server without.

Three runs on SmolLM2-135M-Instruct (bench/lora.py's bundles and rank-16 adapters), each
`--clients` streaming clients of `--requests-per-client` requests:
- the base bundle, every request to the base;
- the bundle with 4 adapter slots, served with `--lora-modules` of the 4 adapters, each client
  naming its own (clients % 4): a decode batch of 8 mixes 4 distinct adapters;
- the same bundle and clients on the base (3 adapters served), one long request each, while
  another loads the fourth through `POST /v1/load_lora_adapter` once they all decode: the load's
  wall time, and the longest gap between two streamed tokens of any request during it, against
  the median gap (a step) and the p99 gap outside it.
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


async def load_during(url: str, models: list[str], args: Any, path: str) -> dict[str, float]:
    """The base clients, and a load of the adapter at `path` once they are decoding."""

    async def load() -> tuple[float, float]:
        await asyncio.sleep(2.0)  # every client's first request decoding
        async with httpx.AsyncClient(timeout=600) as http:
            t0 = time.perf_counter()
            body = {"lora_name": "loaded", "lora_path": path}
            resp = await http.post(f"{url}/v1/load_lora_adapter", json=body)
            resp.raise_for_status()
            return t0, time.perf_counter()

    # one long request a client: every row decodes while the load runs (no prefill between)
    run = clients(url, models, 1, args.input_len, 3 * args.output_len)
    (streams, wall), (start, end) = await asyncio.gather(run, load())
    pairs = [(a, b) for s in streams for a, b in zip(s, s[1:], strict=False)]
    during = [b - a for a, b in pairs if b > start and a < end]
    outside = sorted(b - a for a, b in pairs if not (b > start and a < end))
    return {
        **summary(streams, wall),
        "load_ms": 1000 * (end - start),
        "longest_gap_during_load_ms": 1000 * max(during, default=0.0),
        "gaps_during_load": len(during),
        "median_gap_ms": 1000 * statistics.median(outside),
        "p99_gap_outside_load_ms": 1000 * outside[int(0.99 * (len(outside) - 1))],
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
