"""One hostile request cannot hurt the server: a number no tensor can hold, a field of the wrong
kind, too many stop strings, each is a 400 naming its field, the server stays up, and the next
good request answers exactly as before (docs/serving.md, "Request limits")."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.xdist_group("server")

# the request that killed the server: a stop token id past int64, which min_tokens writes into
# the graph's bias ids (an int64 array) on the engine core's step, taking down every request
KILLER = {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [2**64]}
GOOD = {"prompt": "def main():\n    return", "max_tokens": 8, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

# (endpoint, body (a str: the raw body), the param its 400 names): the worst of
# tests/unit/test_hostile_requests.py
CASES: list[tuple[str, dict[str, Any] | str, str | None]] = [
    ("completions", KILLER, "stop_token_ids"),
    ("completions", {**KILLER, "stop_token_ids": [10**9]}, "stop_token_ids"),  # past the vocab
    ("completions", {**KILLER, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": [[1, 2], [3, 2**64]], "max_tokens": 2}, "prompt"),
    ("completions", {"prompt": [[[1]]], "max_tokens": 2}, "prompt"),
    ("completions", {"prompt": "hi", "logit_bias": {str(2**64): 5}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": float("inf")}}, "logit_bias"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "seed": True}, "seed"),
    ("completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 3.0}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ("completions", {"prompt": "hi", "stop": ["x"] * 65}, "stop"),
    ("completions", {"prompt": "hi", "stop": "x" * 257}, "stop"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2**70}, "top_logprobs"),
    ("chat/completions", {**CHAT, "min_tokens": 1, "stop_token_ids": [2**63]}, "stop_token_ids"),
    ("completions", '{"model": "tiny", "prompt": "hi", "seed": ' + "9" * 5000 + "}", "seed"),
    ("completions", '{"model": "tiny", "prompt": "hi", "temperature": 1e400}', "temperature"),
    ("completions", '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
]


def _post(server: Server, endpoint: str, body: dict[str, Any] | str) -> httpx.Response:
    """A dict as Python's json writes it (NaN and Infinity included: what a client built on
    json.dumps sends), a str as it is."""
    raw = body if isinstance(body, str) else json.dumps({"model": "tiny", **body})
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}/v1/{endpoint}", content=raw, headers=headers, timeout=60)


def _good(server: Server) -> str:
    answer = _post(server, "completions", GOOD)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def test_hostile_fields_are_400s_and_the_server_lives_on(server: Server) -> None:
    want = _good(server)
    for endpoint, body, param in CASES:
        answer = _post(server, endpoint, body)
        assert answer.status_code == 400, (str(body)[:200], answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert server.proc.poll() is None, server.stderr()
        assert _good(server) == want, str(body)[:200]


def test_a_killer_request_leaves_in_flight_requests_alone(server: Server) -> None:
    """A stream in flight when the killer arrives finishes whole (it got a 500 when the engine
    core died under it)."""
    started, chunks = threading.Event(), []
    body = {"model": "tiny", **GOOD, "max_tokens": 40, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                chunks.append(line)
                started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(timeout=60)
    killed = _post(server, "completions", KILLER)
    thread.join(timeout=60)
    assert killed.status_code == 400, killed.text
    lines = [c for c in chunks if c]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length", last
