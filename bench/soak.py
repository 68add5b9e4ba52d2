"""Soak the OpenAI server: mixed traffic for a long time, then check it leaked nothing.

Concurrency 16 clients on SmolLM2-135M-Instruct (manifests/smollm2-soak.yaml: speculation on,
the full sampler, prefix caching), each sending, at random: completions whose prompts share one
of a few long prefixes (prefix caching), chats constrained by a JSON schema (structured outputs),
streams the client drops after a few chunks, requests it aborts by timing out, and hostile
requests (huge or non-finite numbers, deep nesting, wrong content type, oversized bodies, too
many stop strings, pathological grammars). Every answer is classified by status; the server's
resident memory (its process and the engine core's) is sampled throughout.

    python bench/soak.py                    # 30 minutes, concurrency 16 → bench/results/soak.json
    python bench/soak.py --minutes 2 --result soak_short

Passes when no answer is a 5xx, every request but the ones the client abandons gets an answer,
the server is alive at the end, its RSS at the end is within 5% of its RSS after the warm-up, and
`vllm:kv_cache_usage_perc` is back to 0 once traffic stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, parse_args, start_server, write_result  # noqa: E402
from soak_traffic import HOSTILE, PREFIXES, QUESTIONS, SCHEMA  # noqa: E402

MANIFEST = REPO / "manifests" / "smollm2-soak.yaml"
BUNDLE = REPO / "bundles" / "smollm2-135m-instruct-soak"
KINDS = {"prefix": 5, "structured": 2, "dropped": 1, "aborted": 1, "hostile": 1}
WARM_UP_S = 180.0  # RSS is compared against its value at the end of the warm-up


class Tally:
    """Answers by kind and status class, every 5xx's body, and requests that got no answer
    (the connection failed, or a client timed out one it was not meant to abandon)."""

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.server_errors: list[str] = []
        self.unanswered: list[str] = []

    def add(self, kind: str, status: int, body: str = "") -> None:
        self.by_kind[kind] += 1
        self.statuses[f"{status // 100}xx" if status else "abandoned by the client"] += 1
        if status >= 500:
            self.server_errors.append(f"{kind} {status}: {body[:300]}")

    def lost(self, kind: str, why: str) -> None:
        self.by_kind[kind] += 1
        self.statuses["no answer"] += 1
        self.unanswered.append(f"{kind}: {why}")


async def _prefix(http: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    body = {
        "prompt": rng.choice(PREFIXES) + rng.choice(QUESTIONS),
        "max_tokens": rng.randint(8, 48),
        "temperature": rng.choice([0.0, 0.7]),
        "stream": True,
    }
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        text = "".join([line async for line in resp.aiter_lines()])
        tally.add("prefix", resp.status_code, text)


async def _structured(http: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "Describe a city as JSON. " + rng.choice(QUESTIONS)}
        ],
        "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    }
    resp = await http.post(f"{url}/v1/chat/completions", json=body)
    tally.add("structured", resp.status_code, resp.text)


async def _dropped(http: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    """A stream the client leaves after a few chunks: its sequence and blocks must be freed."""
    body = {"prompt": rng.choice(QUESTIONS), "max_tokens": 64, "ignore_eos": True, "stream": True}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        seen = 0
        async for _ in resp.aiter_lines():
            seen += 1
            if seen >= rng.randint(2, 6):
                break
        tally.add("dropped", resp.status_code)


async def _aborted(http: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    """A whole-response request the client gives up on before it is done."""
    body = {"prompt": rng.choice(QUESTIONS), "max_tokens": 128, "ignore_eos": True}
    try:
        resp = await http.post(f"{url}/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5))
        tally.add("aborted", resp.status_code, resp.text)
    except httpx.TimeoutException:
        tally.add("aborted", 0)


async def _hostile(http: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    path, content, headers = rng.choice(HOSTILE)
    resp = await http.post(f"{url}{path}", content=content, headers=headers, timeout=60)
    tally.add("hostile", resp.status_code, resp.text)


SENDERS = {
    "prefix": _prefix,
    "structured": _structured,
    "dropped": _dropped,
    "aborted": _aborted,
    "hostile": _hostile,
}


async def _client(url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items(), strict=True)
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                await SENDERS[kind](http, url, rng, tally)
            except httpx.TransportError as exc:  # no answer: count it, go on
                tally.lost(kind, repr(exc))


def _rss(pid: int) -> int:
    """Resident bytes of the server and its engine core (and rank processes)."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


async def _sample_rss(pid: int, deadline: float, samples: list[tuple[float, int]]) -> None:
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - t0, _rss(pid)))
        await asyncio.sleep(10)


async def _soak(url: str, pid: int, args: argparse.Namespace) -> tuple[Tally, list]:
    tally, samples = Tally(), []
    deadline = time.monotonic() + args.minutes * 60
    clients = [_client(url, i, deadline, tally) for i in range(args.concurrency)]
    await asyncio.gather(_sample_rss(pid, deadline, samples), *clients)
    return tally, samples


def _kv_usage(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise SystemExit("/metrics has no vllm:kv_cache_usage_perc")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--result", default="soak", help="bench/results/NAME.json")
    args = parse_args(ap)
    bundle = ensure_bundle(MANIFEST, BUNDLE)
    proc, url = start_server(bundle, "--no-access-log")
    try:
        tally, samples = asyncio.run(_soak(url, proc.pid, args))
        time.sleep(2)  # the last aborted and dropped requests are freed
        kv_usage = _kv_usage(url)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    warm = [rss for t, rss in samples if t >= min(WARM_UP_S, args.minutes * 30)]
    growth = (warm[-1] - warm[0]) / warm[0] if len(warm) > 1 else 0.0
    result: dict[str, Any] = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests": sum(tally.by_kind.values()),
        "by_kind": dict(tally.by_kind),
        "statuses": dict(tally.statuses),
        "server_errors": tally.server_errors[:20],
        "unanswered": len(tally.unanswered),
        "unanswered_first": tally.unanswered[:20],
        "server_alive_at_end": alive,
        "rss_after_warm_up_mib": round(warm[0] / 2**20, 1) if warm else None,
        "rss_at_end_mib": round(warm[-1] / 2**20, 1) if warm else None,
        "rss_growth": round(growth, 4),
        "kv_cache_usage_at_end": kv_usage,
        "passed": not (tally.server_errors or tally.unanswered)
        and alive
        and growth <= 0.05
        and kv_usage == 0.0,
    }
    print(json.dumps(result, indent=2))
    print("wrote", write_result(args.result, result))
    if not result["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
