"""What an operator expects of an HTTP server beside its routes: a request id on every request
(`X-Request-Id`, the client's own if it sent a sane one), an access log line per request, 404 and
405 answers in the OpenAI error shape every other error has, and request fields the server does
not know said out loud: logged once each as ignored, or refused under `--strict-requests`.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import uuid
from collections.abc import Iterable
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
                ACCESS.info(
                    f"{who} {scope['method']} {scope['path']} {status[0]} {ms:.1f}ms "
                    f"request_id={request_id}"
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
    as ignored, so a client relying on one learns it had no effect (vLLM logs the same)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.logged: set[str] = set()

    def check(self, body: dict[str, Any], known: frozenset[str], request_id: str) -> None:
        unknown = [name for name in body if name not in known]
        if unknown and self.strict:
            raise RequestError(
                f"{unknown[0]} is not a field this server knows (--strict-requests refuses "
                f"unknown fields; unknown here: {', '.join(unknown)})",
                hint="leave it out, or serve without --strict-requests to have it ignored",
                param=unknown[0],
            )
        new = [name for name in unknown if name not in self.logged]
        if new:
            self.logged.update(new)
            SERVER.warning(
                f"neffkit: request {request_id}: the following fields were present in the "
                f"request but ignored: {', '.join(new)} (each field is logged once)"
            )
