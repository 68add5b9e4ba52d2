"""`neffkit run --data-parallel 2` on a real server: greedy outputs equal one engine's, both
replicas serve, a shared prefix follows its cached replica, every series carries its engine, and
a replica killed with SIGKILL is routed around and restarted."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.replicas import complete_all, per_engine
from tests.support.server import Server

pytestmark = pytest.mark.xdist_group("replicas")

PROMPTS = [[(5 * i + j) % 900 + 3 for j in range(4 + i % 9)] for i in range(16)]
SHARED = list(range(200, 232))  # two full blocks of 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def replicas(serve_bundle: Path):
    srv = Server(serve_bundle, "--served-model-name", "tiny", "--data-parallel", "2")
    yield srv
    srv.stop()


def test_replicas_equal_one_engine_and_both_serve(replicas, server):
    assert complete_all(replicas.url, PROMPTS) == complete_all(server.url, PROMPTS)
    routed = per_engine(replicas.url, "neffkit:replica_requests_total")
    assert routed.get("0", 0) > 0 and routed.get("1", 0) > 0, routed
    success = per_engine(replicas.url, "vllm:request_success_total")
    assert sum(success.values()) >= len(PROMPTS) and set(success) == {"0", "1"}
    assert set(per_engine(replicas.url, "vllm:kv_cache_usage_perc")) == {"0", "1"}


def test_a_shared_prefix_follows_the_replica_that_cached_it(replicas):
    before = per_engine(replicas.url, "neffkit:replica_requests_total")
    hits_before = per_engine(replicas.url, "vllm:prefix_cache_hits_total")
    complete_all(
        replicas.url, [[*SHARED, 7, 8, 9, 10]]
    )  # the first: computes and caches the prefix
    tails = [[*SHARED, 11 + i, 40 + i, 70 + i] for i in range(6)]
    complete_all(replicas.url, tails)
    after = per_engine(replicas.url, "neffkit:replica_requests_total")
    moved = {e: after[e] - before.get(e, 0) for e in after}
    engine = max(moved, key=moved.__getitem__)
    assert moved[engine] == 1 + len(tails), moved  # every one on the same replica
    hits = per_engine(replicas.url, "vllm:prefix_cache_hits_total")
    gained = hits.get(engine, 0) - hits_before.get(engine, 0)
    assert gained >= 0.8 * len(SHARED) * len(tails), (gained, hits)


def _engine_pids(server: Server) -> list[int]:
    """The server's engine core processes (multiprocessing's spawned children)."""
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text()
    pids = []
    for pid in map(int, children.split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            pids.append(pid)
    return pids


def _health(server: Server) -> str:
    return httpx.get(f"{server.url}/health", timeout=5).text


def test_a_killed_replica_is_routed_around_and_restarted(replicas):
    pids = _engine_pids(replicas)
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _health(replicas).startswith("degraded") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(replicas).startswith("degraded")
    complete_all(replicas.url, PROMPTS[:8])  # every one a 200 meanwhile (the live replica's)
    deadline = time.monotonic() + 60
    while _health(replicas) != "ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _health(replicas) == "ok", "the replica was not back within 60 s"
    assert sum(per_engine(replicas.url, "neffkit:replica_restarts_total").values()) == 1
    before = per_engine(replicas.url, "neffkit:replica_requests_total")
    complete_all(replicas.url, PROMPTS)
    after = per_engine(replicas.url, "neffkit:replica_requests_total")
    assert all(after[e] > before.get(e, 0) for e in ("0", "1")), (before, after)
    assert len(_engine_pids(replicas)) == 2


def test_tp2_replicas_equal_the_tp2_engine_offline(tp_bundle):
    """Two replicas of a tp=2 bundle (four ranks) answer as the bundle does offline."""
    from tests.support.cli import run_json

    bundle = tp_bundle("llama").bundle
    prompts = PROMPTS[:4]
    args = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    offline = run_json("run", str(bundle), *args, "--max-tokens", str(MAX_TOKENS))["outputs"]
    srv = Server(bundle, "--served-model-name", "tiny", "--data-parallel", "2")
    try:
        assert complete_all(srv.url, prompts) == [o["token_ids"] for o in offline]
        assert set(per_engine(srv.url, "neffkit:replica_requests_total")) == {"0", "1"}
    finally:
        srv.stop()


def _sse(server: Server, route: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}{route}", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data:") and line.removeprefix("data:").strip() != "[DONE]":
                chunks.append(json.loads(line.removeprefix("data:")))
    return chunks


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_bench_serve_payloads_are_served_as_it_reads_them(replicas, route):
    """The bodies `vllm bench serve --backend openai|openai-chat` sends (its
    endpoint_request_func.py, with --ignore-eos and --temperature 0 as extra_body): every field
    accepted, text in the choices' chunks, the usage chunk last with completion_tokens."""
    common = {
        "model": "tiny",
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    if route == "/v1/completions":
        body = {
            **common,
            "prompt": "the quick brown fox",
            "repetition_penalty": 1.0,
            "max_tokens": MAX_TOKENS,
            "logprobs": None,
        }
    else:
        content = [{"type": "text", "text": "the quick brown fox"}]
        body = {
            **common,
            "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": MAX_TOKENS,
        }
    chunks = _sse(replicas, route, body)
    texts = [c for c in chunks if c.get("choices")]
    assert texts and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert not chunks[-1]["choices"]
