"""Hostile requests against the engine (not the HTTP layer): many long stop strings and grammars
that are too large or too slow to compile. Each is answered (a 400 naming its field, or its
text), the server stays alive, and a short stream beside it finishes in time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.xdist_group("server")

# a DFA of 2^31 states, and a lexer of a million expressions
SLOW_REGEX = "(a|b)*a(a|b){30}"
HUGE_REGEX = "(a{1000}){1000}"
GOOD_REGEX = "[0-9]{3}-[a-z]{2}"
BESIDE_S = 3.0  # a short stream beside a hostile request finishes within this


def _schema_format(pattern: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.fixture(scope="module")
def server(serve_bundle: Path) -> Iterator[Server]:
    srv = Server(serve_bundle, "--served-model-name", "tiny")
    # first calls of each graph and the first grammar are slow on a busy host: not measured
    for extra in ({}, {"guided_regex": GOOD_REGEX}):
        assert _complete(srv, **extra).status_code == 200
    yield srv
    srv.stop()


def _complete(server: Server, timeout: float = 60, **body: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout)


def _answers(server: Server) -> list[str]:
    """A plain and a constrained greedy answer: the same before and after a hostile request."""
    return [
        _complete(server, **extra).json()["choices"][0]["text"]
        for extra in ({}, {"guided_regex": GOOD_REGEX})
    ]


def _short_stream(server: Server) -> float:
    """Seconds a short streamed completion takes, first byte to [DONE]."""
    t0 = time.perf_counter()
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return time.perf_counter() - t0


def _beside(server: Server, hostile: Callable[[], Any]) -> tuple[Any, float, float]:
    """Run `hostile()` on a thread and a short stream next to it (started once the hostile
    request is in flight); return its result, its seconds and the stream's seconds."""
    result: dict[str, Any] = {}
    t0 = time.perf_counter()
    worker = threading.Thread(target=lambda: result.setdefault("r", hostile()))
    worker.start()
    time.sleep(0.2)
    took = _short_stream(server)
    worker.join(timeout=120)
    assert not worker.is_alive()
    return result["r"], time.perf_counter() - t0, took


@pytest.mark.parametrize(
    "field,constraint",
    [
        ("guided_regex", {"guided_regex": HUGE_REGEX}),
        ("structured_outputs", {"structured_outputs": {"regex": HUGE_REGEX}}),
    ],
)
def test_a_grammar_too_large_to_compile_is_a_400_and_nothing_stalls(
    server: Server, field: str, constraint: dict[str, Any]
) -> None:
    """It was accepted, and its first token failed the engine's matcher: a 500 "the engine
    failed". Now a 400 naming the field, within seconds, with a stream beside it on time."""
    before = _answers(server)
    resp, seconds, beside = _beside(server, lambda: _complete(server, max_tokens=40, **constraint))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field, resp.text
    assert "too large or too slow to compile" in resp.json()["error"]["message"]
    assert seconds < 10 and beside < BESIDE_S
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert _answers(server) == before


@pytest.mark.parametrize(
    "field,constraint",
    [
        ("guided_regex", {"guided_regex": SLOW_REGEX}),
        ("response_format", {"response_format": _schema_format(SLOW_REGEX)}),
        ("response_format", {"response_format": _schema_format(HUGE_REGEX)}),
    ],
)
def test_grammars_with_a_huge_lexer_are_answered_promptly(
    server: Server, field: str, constraint: dict[str, Any]
) -> None:
    """A regex whose lexer has 2^31 states (built lazily, a few per token: cheap on this
    vocabulary), and both regexes as a JSON schema's pattern: each answered (or refused,
    naming its field) promptly, the stream beside it on time, the server as before."""
    before = _answers(server)
    resp, seconds, beside = _beside(server, lambda: _complete(server, max_tokens=40, **constraint))
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert resp.json()["error"]["param"] == field, resp.text
    assert seconds < 10 and beside < BESIDE_S
    assert _answers(server) == before


def test_many_long_stop_strings_keep_the_engine_responsive(server: Server) -> None:
    """64 stop strings of 256 characters on each of 8 concurrent requests: each runs to its
    length (none occurs), a short stream beside them finishes in time, and the server answers
    as before."""
    stops = [f"{i:03d}" + "z" * 253 for i in range(64)]
    plain = _complete(server, max_tokens=40).json()["choices"][0]["text"]

    def hostile() -> list[httpx.Response]:
        out: list[httpx.Response] = []
        threads = [
            threading.Thread(
                target=lambda: out.append(_complete(server, max_tokens=40, stop=stops))
            )
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    answers, _, beside = _beside(server, hostile)
    assert [a.status_code for a in answers] == [200] * 8
    for answer in answers:  # none occurs: each runs to its length
        choice = answer.json()["choices"][0]
        assert (
            choice["finish_reason"] == "length"
            and answer.json()["usage"]["completion_tokens"] == 40
        )
    assert beside < BESIDE_S
    assert _complete(server, max_tokens=40).json()["choices"][0]["text"] == plain
