"""One hostile HTTP request cannot hurt the server: bodies over the size limit, prompts of
megabytes, request heads that never finish, control characters for the log, endless unknown field
names, routes reached without the API key, JSON nested past Python's recursion, bodies that are
not JSON. After each, the server is alive and a greedy completion is the one it gave before."""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from neffkit.runtime.serve.access import REMEMBERED_FIELDS, UnknownFields
from tests.support.server import Server

# one worker runs this module, so its tests share one server (pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("hostile_http")

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
HEADER_TIMEOUT_S = 2
LIMIT = 16 * 2**20  # --max-request-bytes' default
GOOD = {"model": "tiny", "prompt": "def main():\n    return", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(serve_bundle: Path) -> Iterator[Server]:
    srv = Server(
        serve_bundle,
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
        "--public-metrics",
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def greedy(server: Server) -> str:
    """The greedy completion before any hostile request."""
    return _complete(server)


def _complete(server: Server) -> str:
    resp = httpx.post(f"{server.url}/v1/completions", json=GOOD, headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _still_good(server: Server, greedy: str) -> None:
    assert server.proc.poll() is None, server.stderr()
    assert _complete(server) == greedy


def _error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", status), error
    return error["message"]


def _peak_rss_mib(server: Server) -> float:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]


def _raw(server: Server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(data)
    return sock


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer with an OpenAI error body (the connection may stay open)."""
    got = b""
    while not got.endswith(b"}}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_bodies_over_the_limit_are_413s_and_never_held(server: Server, greedy: str) -> None:
    """Content-Length over the limit: a 413 before a byte of the body is read; a chunked body:
    counted as it arrives (a 200 MB one used to be read whole, a 64 MB one stalled the server)."""
    peak = _peak_rss_mib(server)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer hostile-key\r\n"
        b"Content-Type: application/json\r\nContent-Length: 200000000\r\n\r\n{"
    )
    with _raw(server, head) as sock:  # the body never comes: the answer must not wait for it
        answer = _read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"--max-request-bytes" in answer
    _still_good(server, greedy)

    big = b'{"prompt": "' + b"a" * LIMIT + b'"}'
    message = _error(httpx.post(f"{server.url}/v1/completions", content=big, headers=JSON), 413)
    assert message.startswith(f"request body is over this server's limit of {LIMIT} bytes")
    _still_good(server, greedy)

    def chunked() -> Iterator[bytes]:  # no Content-Length: 200 MiB in 1 MiB chunks
        yield b'{"prompt": "'
        yield from (b"a" * 2**20 for _ in range(200))
        yield b'"}'

    sent = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers=JSON, timeout=60)
    _error(sent, 413)
    _still_good(server, greedy)
    assert _peak_rss_mib(server) - peak < 64  # never more than the limit held

    # the limit is the body's size: a valid body just under it is served
    padded = json.dumps(GOOD).encode()
    padded = padded[:-1] + b" " * (LIMIT - len(padded)) + b"}"
    resp = httpx.post(f"{server.url}/v1/completions", content=padded, headers=JSON, timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy
    _still_good(server, greedy)


def test_health_answers_while_a_prompt_of_megabytes_tokenizes(server: Server, greedy: str) -> None:
    """Tokenizing 8 MB (seconds) runs off the event loop: it used to block /health 9-19 s."""
    prompt = "hello world " * 700_000
    done: dict[str, httpx.Response] = {}

    def send() -> None:
        body = {**GOOD, "prompt": prompt}
        done["big"] = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120
        )

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    time.sleep(0.3)  # the body sent and parsed: tokenizing
    while sender.is_alive():
        start = time.perf_counter()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.1)
    sender.join()
    assert len(waits) >= 3, waits  # probed while it tokenized
    assert max(waits) < 1.0, waits
    _error(done["big"], 400)  # then refused for its length
    assert done["big"].json()["error"]["param"] == "prompt"
    _still_good(server, greedy)


def test_a_request_head_that_never_finishes_is_closed(server: Server, greedy: str) -> None:
    """Slowloris: heads that stall, or trickle a byte at a time (which restarts uvicorn's own
    keep-alive timer), are closed at --header-timeout; others are served meanwhile."""
    start = time.monotonic()
    stalled = [_raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(20)]
    _still_good(server, greedy)
    trickle = _raw(server, b"G")
    for byte in b"ET /health HTTP/1.1\r\nX-Slow: " + b"a" * 40:  # a byte each 0.2 s
        if select.select([trickle], [], [], 0.2)[0]:  # closed by the server
            break
        trickle.sendall(bytes([byte]))
    for sock in [*stalled, trickle]:
        with sock:
            assert sock.recv(100) == b""  # closed by the server (a timeout raises)
    elapsed = time.monotonic() - start
    assert HEADER_TIMEOUT_S - 0.5 < elapsed < HEADER_TIMEOUT_S + 3, elapsed
    _still_good(server, greedy)

    with _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000) as sock:
        answer = sock.recv(1000)  # a head over 16 KiB: 400, closed
        assert answer.startswith(b"HTTP/1.1 400 "), answer
    _still_good(server, greedy)


def _lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_control_characters_cannot_forge_log_lines(server: Server, greedy: str) -> None:
    """A `%0A` in the path and a newline in a field name are written escaped: each request is
    still one access line, its ignored fields one warning line."""
    resp = httpx.get(
        f"{server.url}/v1/x%0Aforged%20line%0D%1B[31m", headers={**AUTH, "X-Request-Id": "inj-1"}
    )
    assert resp.status_code == 404
    body = {**GOOD, "evil\nforged line\r": 1, "bell\x07\u2028sep\\n": 2}
    resp = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={**AUTH, "X-Request-Id": "inj-2"}
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy
    deadline = time.monotonic() + 10
    while "request_id=inj-2" not in server.stdout() and time.monotonic() < deadline:
        time.sleep(0.1)
    out, err = server.stdout(), server.stderr()
    access = _lines_with(out, "forged")
    assert len(access) == 1 and access == _lines_with(out, "request_id=inj-1"), out
    assert r" GET /v1/x\nforged line\r\x1b[31m 404 " in access[0]
    assert len(_lines_with(out, "request_id=inj-2")) == 1
    warned = _lines_with(err, "request inj-2")
    assert len(warned) == 1 and "forged" in warned[0], err
    assert r"evil\nforged line\r, bell\x07\u2028sep\\n (each field" in warned[0]
    assert not any(line.startswith("forged") for line in (out + err).splitlines())
    _still_good(server, greedy)


def test_unknown_field_names_are_remembered_up_to_a_bound(caplog) -> None:
    """A million distinct unknown names used to grow the logged set to 127 MiB."""
    fields = UnknownFields(strict=False)
    with caplog.at_level(logging.WARNING, logger="neffkit.server"):
        for batch in range(10):
            body = {f"name-{batch}-{i}" + "x" * 1000 * (i < 100): 1 for i in range(100_000)}
            fields.check(body, frozenset(), f"req-{batch}")
    assert len(fields.logged) == REMEMBERED_FIELDS
    assert sum(map(len, fields.logged)) < 64 * REMEMBERED_FIELDS
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10  # one line a request, each listing a few names and a count
    assert lines[0].endswith(
        "and 99984 more (the server remembers 1024 names: these may be logged again)"
    )
    assert max(map(len, lines)) < 1500  # 16 names of at most 64 characters, and a count
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neffkit.server"):
        fields.check({"name-0-0" + "x" * 1000: 1}, frozenset(), "again")  # remembered
    assert caplog.records == []


def test_many_unknown_fields_are_one_short_line(server: Server, greedy: str) -> None:
    body = {**GOOD, **{f"junk{i}\n": i for i in range(50_000)}}
    resp = httpx.post(
        f"{server.url}/v1/completions",
        json=body,
        headers={**AUTH, "X-Request-Id": "many-fields"},
        timeout=30,
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy
    warned = _lines_with(server.stderr(), "request many-fields")
    assert len(warned) == 1 and len(warned[0]) < 1000 and "and 49984 more" in warned[0]
    _still_good(server, greedy)


def test_the_api_key_covers_every_route_but_health(
    server: Server, serve_bundle: Path, greedy: str
) -> None:
    """/version, /openapi.json and unknown paths too (they were open); /metrics is open here
    under --public-metrics; the scheme is matched without case."""
    url = server.url
    for path in ["/version", "/openapi.json", "/v1/models", "/nope"]:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}]:
            resp = httpx.get(f"{url}{path}", headers=headers)
            assert resp.status_code == 401, (path, headers)
            assert resp.json()["error"]["type"] == "authentication_error"
            assert resp.headers["www-authenticate"] == "Bearer"
    for scheme in ["Bearer", "bearer", "BEARER"]:
        resp = httpx.get(f"{url}/version", headers={"Authorization": f"{scheme} {KEY}"})
        assert resp.status_code == 200
    refused = httpx.post(f"{url}/v1/completions", json=GOOD)
    assert refused.status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").text.startswith("# HELP")  # --public-metrics
    _still_good(server, greedy)

    closed = Server(serve_bundle, "--api-key", KEY)  # without --public-metrics
    try:
        assert httpx.get(f"{closed.url}/metrics").status_code == 401
        assert httpx.get(f"{closed.url}/metrics", headers=AUTH).status_code == 200
        assert httpx.get(f"{closed.url}/health").status_code == 200
    finally:
        closed.stop()


def test_json_nested_past_recursion_is_a_400(server: Server, greedy: str) -> None:
    """100,000 `[` used to be a 500."""
    for raw in [b"[" * 100_000, b'{"prompt": "hi", "x": ' + b"[" * 100_000]:
        message = _error(httpx.post(f"{server.url}/v1/completions", content=raw, headers=JSON), 400)
        assert "request body" in message and "nest" in message, message
        _still_good(server, greedy)


def test_post_bodies_must_be_json(server: Server, greedy: str) -> None:
    """A text/plain POST (what a page may send to any origin without a preflight) is a 415."""
    raw = json.dumps(GOOD)
    for kind in ["text/plain", "application/x-www-form-urlencoded", None, "application/jsonx"]:
        headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
        for path in ["/v1/completions", "/v1/chat/completions"]:
            resp = httpx.post(f"{server.url}{path}", content=raw, headers=headers)
            message = _error(resp, 415)
            assert "expected application/json" in message, message
    for kind in ["application/json; charset=utf-8", "Application/JSON"]:
        headers = {**AUTH, "Content-Type": kind}
        resp = httpx.post(f"{server.url}/v1/completions", content=raw, headers=headers)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy
    _still_good(server, greedy)
