"""Preemption and priority scheduling through the OpenAI-compatible server: a real `neffkit run`
process on the tiny server bundle (tests/support/server.py), its KV pool cut to 3 usable blocks of
16 tokens with --num-gpu-blocks-override (one 48-token request at a time), driven by the real
`openai` client. Requests that do not fit together preempt one another and recompute; each still
equals the same request run alone, greedy or seeded."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.xdist_group("scheduling_server")

MAX_NEW = 28  # + a prompt of up to 20 tokens: 48 tokens, the whole pool


@pytest.fixture(scope="module")
def small_pool(serve_bundle: Path) -> Iterator[Server]:
    srv = Server(
        serve_bundle,
        "--served-model-name",
        "tiny",
        "--scheduling-policy",
        "priority",
        "--num-gpu-blocks-override",
        "4",
    )
    yield srv
    srv.stop()


def _jobs() -> list[dict]:
    """16 requests: prompts of 6-20 tokens, half greedy, half seeded sampling."""
    jobs = []
    for i in range(16):
        prompt = [(7 * i + 3 * j) % 200 + 1 for j in range(6 + i % 15)]
        sampled = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {"temperature": 0}
        jobs.append({"prompt": prompt, "max_tokens": MAX_NEW, **sampled})
    return jobs


async def _run(srv: Server, jobs: list[dict], done: list[str] | None = None) -> list[list[int]]:
    """Every job at once; `done` gets each job's "tag" as it finishes."""
    client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused")

    async def one(job: dict) -> list[int]:
        extra = {"return_token_ids": True, "ignore_eos": True}
        if "priority" in job:
            extra["priority"] = job["priority"]
        fields = {k: v for k, v in job.items() if k not in ("priority", "tag")}
        out = await client.completions.create(model="tiny", extra_body=extra, **fields)
        if done is not None:
            done.append(job["tag"])
        return (out.choices[0].model_extra or {})["token_ids"]

    try:
        return await asyncio.gather(*(one(job) for job in jobs))
    finally:
        await client.close()


def _preemptions(srv: Server) -> float:
    found = re.search(r"^vllm:num_preemptions_total{[^}]*} (\S+)$", srv.metrics(), re.M)
    assert found, "vllm:num_preemptions_total is not exported"
    return float(found.group(1))


def test_requests_that_do_not_fit_together_are_preempted_and_unchanged(small_pool) -> None:
    jobs = _jobs()
    alone = [asyncio.run(_run(small_pool, [job]))[0] for job in jobs]
    assert _preemptions(small_pool) == 0  # one at a time: each fits
    together = asyncio.run(_run(small_pool, jobs))
    assert _preemptions(small_pool) > 0
    for i, (want, got) in enumerate(zip(alone, together, strict=True)):
        assert len(got) == MAX_NEW and got == want, i


def test_a_later_priority_request_finishes_before_earlier_lower_ones(small_pool) -> None:
    """20-token prompts: one admitted at a time (2 blocks, growing to 3, of 3), so the others
    wait; a priority-0 arrival goes before the priority-10 ones still waiting (and takes the
    running one's blocks). Twelve low ones, one warm connection: several still wait when the
    high one lands, however slow the host."""

    def body(i: int, priority: int) -> dict:  # distinct prompts: no shared prefix
        prompt = [(5 * j + 11 * i) % 97 + 1 for j in range(20)]
        return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW, "priority": priority}

    async def scenario() -> list[str]:
        done: list[str] = []
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=small_pool.url, timeout=120, limits=limits) as http:

            async def send(tag: str, payload: dict) -> None:
                reply = await http.post("/v1/completions", json=payload)
                assert reply.status_code == 200, reply.text
                done.append(tag)

            await http.get("/health")
            low = [asyncio.ensure_future(send(f"low{i}", body(i, 10))) for i in range(12)]
            waiting = r"^vllm:num_requests_waiting{[^}]*} (\S+)$"
            deadline = time.monotonic() + 30
            while float(re.search(waiting, (await http.get("/metrics")).text, re.M)[1]) < 3:
                assert time.monotonic() < deadline and not done, f"no queue formed: {done}"
                await asyncio.sleep(0.005)
            await send("high", body(12, 0))
            await asyncio.gather(*low)
        return done

    done = asyncio.run(scenario())
    assert len(done) - 1 - done.index("high") >= 2, done  # low ones that waited, finished after


def test_a_request_larger_than_the_pool_is_refused_with_the_limit(small_pool) -> None:
    client = small_pool.client()
    with pytest.raises(
        openai.BadRequestError, match="needs 4 KV blocks of 16 tokens; the KV pool holds 3"
    ):
        client.completions.create(model="tiny", prompt=list(range(1, 21)), max_tokens=40)
