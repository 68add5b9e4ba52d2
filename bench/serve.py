"""Load the OpenAI server with N concurrent streaming clients; report vLLM-style serving metrics.

Definitions follow `vllm bench serve`: TTFT = first streamed token − request sent;
TPOT = (e2e − TTFT) / (output tokens − 1) per request; ITL = gaps between streamed chunks;
throughput = all output tokens / wall time of the whole run. Prompts are random token ids of a
fixed length, outputs a fixed length with ignore_eos, so every request does the same work.

    python bench/serve.py                         # manifests/demo-serve.yaml, concurrency 1 4 8
    python bench/serve.py --url http://host:8000  # an already running server
    python bench/serve.py --bundle bench/work/batch/bundle-float32-kernel --name serve_125m \
                                                  --concurrency 1 8 --requests-per-client 4
                                                  # the 125M model of bench/batch.py
    python bench/serve.py --shared-prefix 128 --name serve_prefix
                                                  # shared prefixes, prefix caching on and off
    python bench/serve.py --adapters --requests-per-client 4
                                                  # SmolLM2: 4 LoRA adapters against the base,
                                                  # and an adapter loaded mid-run (serve_lora.py)
    python bench/serve.py --preemption --requests-per-client 2
                                                  # SmolLM2 under a KV pool that forces
                                                  # preemption (serve_preemption.py)

With --shared-prefix N each prompt is one of --prefixes shared N-token prefixes followed by its
own --input-len tokens (a system prompt and a question), and the run serves the same requests
twice, from a server with prefix caching and one started with --no-prefix-caching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    REPO,
    ensure_bundle,
    parse_args,
    start_server,
    write_result,
)


async def one_request(
    http: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    stamps: list[float] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
    e2e = stamps[-1] - sent
    ttft = stamps[0] - sent
    return {
        "ttft": ttft,
        "tpot": (e2e - ttft) / max(out_len - 1, 1),
        "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "e2e": e2e,
        "tokens": out_len,
    }


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean_ms": 1000 * statistics.fmean(values),
        "median_ms": 1000 * statistics.median(values),
        "p99_ms": 1000 * p99,
    }


def workload(
    concurrency: int, requests: int, in_len: int, vocab: int, shared: int = 0, prefixes: int = 4
) -> list[list[int]]:
    """Random prompts of in_len tokens, each after one of `prefixes` shared ones (shared > 0);
    the same for every server a run compares."""
    rng = random.Random(concurrency)
    heads = [[rng.randrange(3, vocab) for _ in range(shared)] for _ in range(prefixes)]
    return [
        (rng.choice(heads) if shared else []) + [rng.randrange(3, vocab) for _ in range(in_len)]
        for _ in range(requests)
    ]


async def run_level(
    url: str, model: str, concurrency: int, prompts: list[list[int]], out_len: int
) -> dict[str, Any]:
    requests = len(prompts)
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict[str, Any]] = []

    async def client() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    results.append(await one_request(http, url, model, prompt, out_len))
                except httpx.RemoteProtocolError:  # a kept-alive connection the server closed
                    results.append(await one_request(http, url, model, prompt, out_len))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": requests,
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "requests_per_s": requests / wall,
        "ttft": _stats([r["ttft"] for r in results]),
        "tpot": _stats([r["tpot"] for r in results]),
        "itl": _stats([g for r in results for g in r["itl"]]),
        "e2e": _stats([r["e2e"] for r in results]),
    }


def engine_only(bundle: Path, concurrency: int, in_len: int, out_len: int, vocab: int) -> float:
    """Output tokens/s of the same work through LLM.generate in this process, no HTTP: the
    ceiling the server is measured against (same intra-op threads as the server's engine core)."""
    import torch

    from neffkit.runtime.engine.core import engine_threads
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    torch.set_num_threads(engine_threads())
    engine = LLM(load(bundle))
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(concurrency)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    warm_up = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, warm_up)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return concurrency * out_len / (time.perf_counter() - t0)


def serve_levels(url: str, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    levels = []
    for c in args.concurrency:
        prompts = workload(
            c,
            c * args.requests_per_client,
            args.input_len,
            vocab,
            args.shared_prefix,
            args.prefixes,
        )
        level = asyncio.run(run_level(url, model, c, prompts, args.output_len))
        levels.append(level)
        print(
            f"concurrency {c:>2}: {level['output_tokens_per_s']:8.1f} output tok/s, "
            f"TTFT median {level['ttft']['median_ms']:.1f} ms, "
            f"TPOT median {level['tpot']['median_ms']:.2f} ms, "
            f"ITL p99 {level['itl']['p99_ms']:.2f} ms"
        )
    base = levels[0]["output_tokens_per_s"]
    for level in levels:
        level["throughput_vs_first"] = level["output_tokens_per_s"] / base
    return levels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="A running server; default: start one on the demo bundle.")
    ap.add_argument("--bundle", type=Path, default=REPO / "bundles" / "demo-llama-serve")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests-per-client", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a shared prefix")
    ap.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes")
    ap.add_argument("--name", default="serve", help="result file: bench/results/NAME.json")
    ap.add_argument(
        "--adapters",
        action="store_true",
        help="SmolLM2 with 4 LoRA adapters against the base, and a load mid-run (serve_lora.py)",
    )
    ap.add_argument(
        "--preemption",
        action="store_true",
        help="SmolLM2 under a KV pool that forces preemption and the whole pool "
        "(serve_preemption.py)",
    )
    ap.add_argument("--clients", type=int, default=8, help="--adapters, --preemption: clients")
    ap.add_argument("--rounds", type=int, default=3, help="--preemption: alternating rounds")
    args = parse_args(ap)
    if args.preemption:
        from serve_preemption import run_preemption

        name = args.name if args.name != "serve" else "serve_preemption"
        print(f"written {write_result(name, run_preemption(args))}")
        return
    if args.adapters:
        from serve_lora import run_adapters

        name = args.name if args.name != "serve" else "serve_lora"
        print(f"written {write_result(name, run_adapters(args))}")
        return
    vocab = 1000
    result: dict[str, Any] = {
        "bundle": str(
            args.bundle.relative_to(REPO) if args.bundle.is_relative_to(REPO) else args.bundle
        ),
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    if args.url is not None:
        result["levels"] = serve_levels(args.url, args, vocab)
    else:
        if args.bundle == REPO / "bundles" / "demo-llama-serve":
            ensure_bundle(REPO / "manifests" / "demo-serve.yaml", args.bundle)
        runs = [("levels", ())]
        if args.shared_prefix:  # the same requests with the cache and without
            result.update(shared_prefix=args.shared_prefix, prefixes=args.prefixes)
            runs = [("prefix_caching_on", ()), ("prefix_caching_off", ("--no-prefix-caching",))]
        for key, flags in runs:
            print(f"{key}:")
            proc, url = start_server(args.bundle, *flags)
            try:
                result[key] = serve_levels(url, args, vocab)
            finally:
                proc.terminate()
                proc.wait()
        if not args.shared_prefix:
            for level in result["levels"]:
                level["engine_only_tokens_per_s"] = engine_only(
                    args.bundle, level["concurrency"], args.input_len, args.output_len, vocab
                )
                print(
                    f"concurrency {level['concurrency']:>2}: engine alone (no HTTP) "
                    f"{level['engine_only_tokens_per_s']:8.1f} output tok/s"
                )
    print(f"written {write_result(args.name, result)}")


if __name__ == "__main__":
    main()
