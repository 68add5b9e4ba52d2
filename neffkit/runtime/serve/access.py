"""What an operator expects of an HTTP server beside its routes: a request id on every request
(`X-Request-Id`, the client's own if it sent a sane one), an access log line per request (what a
client sent escaped, so it cannot forge lines), the API key on every route but /health, request
bodies read only as JSON and only up to a size limit, 404 and 405 answers in the OpenAI error shape
every other error has, and request fields the server does not know said out loud: logged once each
as ignored (up to a bound on the names remembered), or refused under `--strict-requests`.
"""

from __future__ import annotations

import hmac
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neffkit.errors import RequestError

ACCESS = logging.getLogger("neffkit.access")
SERVER = logging.getLogger("neffkit.server")
REQUEST_ID = "neffkit.request_id"  # the scope key the routes read the request id from
_SANE_ID = re.compile(r"[\w.:@/+=-]{1,128}")
REMEMBERED_FIELDS = 1024  # unknown field names remembered as logged (each logged once)
_LISTED = 16  # names one log line or error message lists
_NAME_CHARS = 64  # characters of one name a log line or error message shows


@dataclass(frozen=True)
class HttpLimits:
    """What one connection or request may take of the server
    (docs/serving.md#http-limits-and-the-api-key)."""

    max_request_bytes: int = 16 * 2**20  # a body over it: 413 (--max-request-bytes)
    header_timeout_s: float = 10.0  # a request head sent whole within it (--header-timeout)
    keep_alive_s: int = 5  # an idle connection closed after it (--timeout-keep-alive)
    max_header_bytes: int = 16 * 2**10  # request line and headers (h11's default): else 400
    graceful_shutdown_s: int = 30  # on SIGTERM, requests still running are cut after it


class BodyRefused(RequestError):
    """A request body the server will not read: over the size limit (413) or not JSON (415)."""

    default_hint = "what the server reads: docs/serving.md#http-limits-and-the-api-key"

    def __init__(self, message: str, hint: str | None = None, status: int = 400) -> None:
        super().__init__(message, hint)
        self.status = status


def loggable(text: str, limit: int | None = None) -> str:
    """`text` for a log line: control characters (a `%0A` in a path, a CR in a field name) and
    backslashes escaped as Python writes them (`\\n`, `\\x1b`, `\\u2028`), so what a client sent can
    neither split a line nor forge one; cut to `limit` characters (then `…`)."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def listed(names: list[str]) -> str:
    """Names for a log line or a message: the first few, each escaped and cut, and a count."""
    shown = ", ".join(loggable(n, _NAME_CHARS) for n in names[:_LISTED])
    more = len(names) - _LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def error_body(message: str, kind: str, param: str | None = None, code: int = 400) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=code,
    )


def enable_access_log() -> None:
    """Access lines to stdout (as uvicorn's), whatever level the CLI's logging was set to."""
    if not ACCESS.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        ACCESS.addHandler(handler)
    ACCESS.setLevel(logging.INFO)
    ACCESS.propagate = False


class AccessLog:
    """ASGI middleware: gives each request an id (returned as `X-Request-Id`) and, with `log`,
    writes one line when the response has been sent in full, so a stream's latency is the
    whole stream's: `127.0.0.1:5114 POST /v1/completions 200 41.7ms request_id=req-…`."""

    def __init__(self, app: ASGIApp, log: bool = True) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = sent if _SANE_ID.fullmatch(sent) else f"req-{uuid.uuid4().hex[:16]}"
        scope[REQUEST_ID] = request_id
        status = [500]  # what the client gets if the app raises before it answers
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.log:
                ms = (time.perf_counter() - start) * 1000
                client = scope.get("client")
                who = f"{client[0]}:{client[1]}" if client else "-"
                path = loggable(scope["path"])  # percent-decoded: %0A is a newline here
                ACCESS.info(
                    f"{who} {scope['method']} {path} {status[0]} {ms:.1f}ms request_id={request_id}"
                )


def add_http_errors(api: FastAPI) -> None:
    """404 and 405 (and any other HTTPException) as OpenAI error bodies naming the request."""

    @api.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        asked = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            endpoints = _endpoints(
                r for r in api.routes if getattr(r, "path", None) != api.openapi_url
            )
            message = f"{asked}: no such endpoint; this server has {endpoints}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{asked}: method not allowed; this endpoint takes {allowed}"
        else:
            message = f"{asked}: {exc.detail}"
        response = error_body(message, "invalid_request_error", code=exc.status_code)
        response.headers.update(exc.headers or {})
        return response


def _endpoints(routes: Iterable[Any]) -> str:
    found = [
        f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}"
        for r in routes
        if isinstance(r, Route) and r.methods
    ]
    return ", ".join(found)


class UnknownFields:
    """Request fields the server does not know: refused (strict) or logged once per field name
    as ignored, so a client relying on one learns it had no effect (vLLM logs the same). At most
    `remember` names, of at most 64 characters, are remembered as logged (the bodies of a million
    distinct or endless names would otherwise grow the set without end); past that, a new name is
    logged but not remembered.
    Called from worker threads, hence the lock."""

    def __init__(self, strict: bool, remember: int = REMEMBERED_FIELDS) -> None:
        self.strict, self.remember = strict, remember
        self.logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: dict[str, Any], known: frozenset[str], request_id: str) -> None:
        unknown = [name for name in body if name not in known]
        if unknown and self.strict:
            first = loggable(unknown[0], _NAME_CHARS)
            raise RequestError(
                f"{first} is not a field this server knows (--strict-requests refuses "
                f"unknown fields; unknown here: {listed(unknown)})",
                hint="leave it out, or serve without --strict-requests to have it ignored",
                param=first,
            )
        with self._lock:  # a name is remembered by what a line shows of it: its first characters
            new = [name for name in unknown if name[:_NAME_CHARS] not in self.logged]
            room = max(0, self.remember - len(self.logged))
            self.logged.update(name[:_NAME_CHARS] for name in new[:room])
        if new:
            once = (
                "each field is logged once"
                if len(new) <= room
                else f"the server remembers {self.remember} names: these may be logged again"
            )
            SERVER.warning(
                f"neffkit: request {request_id}: the following fields were present in the "
                f"request but ignored: {listed(new)} ({once})"
            )


class ApiKey:
    """ASGI middleware: `Authorization: Bearer KEY` on every route but `open_paths` (/health, for
    load balancers; /metrics too under --public-metrics), else a 401. The scheme is matched
    without case (RFC 7235), the key in constant time."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str]) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._sent_key(scope):
            await self.app(scope, receive, send)
            return
        response = error_body("invalid or missing API key", "authentication_error", code=401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _sent_key(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False


async def read_body(request: Request, limit: int) -> bytes:
    """A POST's JSON body: a 415 unless its Content-Type is application/json (a browser page
    can send text/plain to any origin without asking first), a 413 once it is over `limit`
    bytes, by its Content-Length before a byte is read, or counted as a chunked body arrives,
    so no more than `limit` bytes are ever held."""
    kind = request.headers.get("content-type", "")
    if kind.partition(";")[0].strip().lower() != "application/json":
        raise BodyRefused(
            f"request body must be JSON: Content-Type is {loggable(kind, 64) or 'missing'}, "
            "expected application/json",
            status=415,
            hint="send the header Content-Type: application/json",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(
        f"request body is over this server's limit of {limit} bytes (--max-request-bytes)",
        status=413,
        hint="send a smaller body, or start the server with a larger --max-request-bytes",
    )
