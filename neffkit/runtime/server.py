"""OpenAI-compatible HTTP API over a bundle (FastAPI + uvicorn, as vLLM serves).

POST /v1/completions and /v1/chat/completions (SSE streaming with `data: [DONE]`, `usage`,
`stream_options.include_usage`), GET /v1/models, /health, /version, /metrics (Prometheus, vLLM
names). Bad requests get a 400 with an OpenAI-style error body naming the field; a full waiting
queue gets a 503. A client that disconnects mid-request has its sequence and KV blocks freed.
Binds 127.0.0.1 unless told otherwise; `--api-key` requires `Authorization: Bearer KEY` on /v1.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import neffkit
from neffkit.bundle import Bundle, read_bundle
from neffkit.errors import RequestError
from neffkit.runtime.engine import Engine, SamplingParams
from neffkit.runtime.engine_core import start_core
from neffkit.runtime.loader import engine_layout
from neffkit.runtime.metrics import Metrics
from neffkit.runtime.serving import EngineClient, Event, ServerBusy, Stream
from neffkit.runtime.tokenizer import Tokenizer

# used when the bundle's tokenizer has no chat template (documented in the README)
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DISCONNECT_POLL_S = 0.5


class BadRequest(RequestError):
    """400 with the offending field in `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str, param: str | None = None, code: int = 400) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=code,
    )


# ---------------------------------------------------------------- request parsing


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is never a valid number here
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join("number" if k is float else k.__name__ for k in kinds)
        raise BadRequest(f"{name} must be {names}, got {json.dumps(value)}", name)
    return value


def _sampling(body: dict[str, Any], max_tokens_field: str = "max_tokens") -> SamplingParams:
    max_tokens = _get(body, max_tokens_field, (int,), 16)
    if max_tokens <= 0:
        raise BadRequest(f"{max_tokens_field} must be positive, got {max_tokens}", max_tokens_field)
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers", "stop_token_ids")
    if _get(body, "n", (int,), 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=_get(body, "top_k", (int,), 0),
        top_p=top_p,
        seed=_get(body, "seed", (int,), None),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
    )


@dataclass(frozen=True)
class Parsed:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise BadRequest("stop must be a string or a list of strings", "stop")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    return stream, bool(options.get("include_usage", False))


# ---------------------------------------------------------------- the app


class App:
    def __init__(
        self,
        bundle: Bundle,
        tokenizer: Tokenizer | None,
        engine_loop: EngineClient,
        metrics: Metrics,
        model_name: str,
        api_key: str | None = None,
    ) -> None:
        self.loop, self.metrics = engine_loop, metrics
        self.model_name, self.api_key = model_name, api_key
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.digest = bundle.digest
        self.chat_template = self._chat_template()

    def _chat_template(self) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source = None
        if self.tokenizer is not None:
            source = self.tokenizer.chat_template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(source or DEFAULT_CHAT_TEMPLATE)

    # ------------------------------------------------------------ parsing

    def _check_model(self, body: dict[str, Any]) -> None:
        model = _get(body, "model", (str,), self.model_name)
        if model != self.model_name:
            raise BadRequest(
                f"model {model!r} does not exist; this server has {self.model_name!r}", "model"
            )

    def _encode(self, text: str, field: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(f"this bundle has no tokenizer: send {field} as token ids", field)
        return self.tokenizer.encode(text)

    def parse_completion(self, body: dict[str, Any]) -> Parsed:
        self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt")
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
        else:
            raise BadRequest(
                "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
            )
        return Parsed(ids, _sampling(body), _stop(body), *_stream_flags(body))

    def parse_chat(self, body: dict[str, Any]) -> Parsed:
        self._check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        flat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
            content = m.get("content", "")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string", "messages")
            flat.append({"role": m["role"], "content": content})
        text = self.chat_template.render(
            messages=flat, add_generation_prompt=True, bos_token="", eos_token=""
        )
        field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        return Parsed(
            self._encode(text, "messages"),
            _sampling(body, field),
            _stop(body),
            *_stream_flags(body),
        )

    # ------------------------------------------------------------ running

    def submit(self, parsed: Parsed) -> tuple[Stream, asyncio.Queue[Event]]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        stream = self.loop.submit(
            parsed.prompt_ids,
            parsed.params,
            parsed.stop,
            lambda event: loop.call_soon_threadsafe(queue.put_nowait, event),
        )
        return stream, queue

    async def collect(self, request: Request, stream: Stream, queue: asyncio.Queue[Event]) -> Event:
        """Wait for the whole output; abort if the client disconnects meanwhile."""
        text, ids = [], []
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self.loop.abort(stream)
                    raise
                continue
            text.append(event.text)
            ids += event.token_ids
            if event.finish_reason is not None:
                return Event("".join(text), ids, event.finish_reason, event.prompt_tokens,
                             event.completion_tokens)  # fmt: skip

    async def sse(
        self, stream: Stream, queue: asyncio.Queue[Event], chunk: Callable[[Event | None], dict],
        usage_chunk: Callable[[Event], dict] | None,
    ) -> AsyncIterator[str]:  # fmt: skip
        """`data: {json}` per event, then usage (if asked), then `data: [DONE]`."""
        finished = False
        try:
            first = chunk(None)
            if first:
                yield f"data: {json.dumps(first)}\n\n"
            while True:
                event = await queue.get()
                if event.finish_reason == "error":
                    yield f"data: {json.dumps({'error': {'message': 'engine failure'}})}\n\n"
                    finished = True
                    return
                yield f"data: {json.dumps(chunk(event))}\n\n"
                if event.finish_reason is not None:
                    finished = True
                    if usage_chunk is not None:
                        yield f"data: {json.dumps(usage_chunk(event))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:  # client gone (cancelled) or server stopping: free its KV blocks
                self.loop.abort(stream)


def _usage(event: Event) -> dict[str, int]:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
    }


def create_app(app_state: App) -> FastAPI:
    s = app_state
    api = FastAPI(title="neffkit", version=neffkit.__version__, docs_url=None, redoc_url=None)

    @api.middleware("http")
    async def auth(request: Request, call_next: Callable) -> Response:
        if s.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {s.api_key}":
                return error_body("invalid or missing API key", "authentication_error", code=401)
        return await call_next(request)

    @api.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> Response:
        return error_body(exc.message, "invalid_request_error", exc.param)

    @api.exception_handler(ServerBusy)
    async def busy(request: Request, exc: ServerBusy) -> Response:
        return error_body(exc.message, "server_busy", code=503)

    @api.exception_handler(RequestError)
    async def engine_refusal(request: Request, exc: RequestError) -> Response:
        # the engine's own validation: buckets, KV blocks (it names the prompt and max_tokens)
        param = "max_tokens" if exc.message.startswith("max_tokens") else "prompt"
        hint = f" ({exc.hint})" if exc.hint else ""
        return error_body(exc.message + hint, "invalid_request_error", param)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    @api.get("/health")
    async def health() -> Response:
        if not s.loop.healthy:
            return PlainTextResponse("engine stopped", status_code=503)
        return PlainTextResponse("ok")

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": neffkit.__version__, "bundle_digest": s.digest}

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": s.model_name,
                    "object": "model",
                    "created": s.created,
                    "owned_by": "neffkit",
                    "max_model_len": s.loop.max_model_len,
                }
            ],
        }

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = s.parse_completion(await body_of(request))
        stream, queue = s.submit(parsed)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": s.model_name}

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        def text_chunk(e: Event | None) -> dict[str, Any]:
            return {} if e is None else {**base, "choices": [choice(e.text, e.finish_reason)]}

        def usage_chunk(e: Event) -> dict[str, Any]:
            return {**base, "choices": [], "usage": _usage(e)}

        if parsed.stream:
            usage = usage_chunk if parsed.include_usage else None
            return StreamingResponse(
                s.sse(stream, queue, text_chunk, usage), media_type="text/event-stream"
            )
        done = await s.collect(request, stream, queue)
        return JSONResponse(
            {**base, "choices": [choice(done.text, done.finish_reason)], "usage": _usage(done)}
        )

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        parsed = s.parse_chat(await body_of(request))
        stream, queue = s.submit(parsed)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": s.model_name}

        def delta_chunk(e: Event | None) -> dict[str, Any]:
            if e is None:  # the first chunk carries the role, as OpenAI's does
                delta, finish = {"role": "assistant", "content": ""}, None
            else:
                delta, finish = ({"content": e.text} if e.text else {}), e.finish_reason
            return {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }

        if parsed.stream:
            return StreamingResponse(
                s.sse(
                    stream, queue, delta_chunk,
                    (lambda e: {**base, "object": "chat.completion.chunk", "choices": [],
                                "usage": _usage(e)}) if parsed.include_usage else None,
                ),
                media_type="text/event-stream",
            )  # fmt: skip
        done = await s.collect(request, stream, queue)
        message = {"role": "assistant", "content": done.text}
        return JSONResponse(
            {
                **base,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason}],
                "usage": _usage(done),
            }
        )

    return api


def serve(
    bundle_path: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    max_waiting: int = 256,
    executor: str = "auto",
    dist_timeout_s: float = 60.0,
) -> None:
    """Serve until SIGINT/SIGTERM. The engine runs in its own process (runtime/engine_core)."""
    import uvicorn

    bundle = read_bundle(bundle_path, verify=False)  # the core verifies hashes as it loads
    name = model_name or bundle.record.name
    record = bundle.record
    tokenizer = Tokenizer.from_dir(bundle.path(record.tokenizer)) if record.tokenizer else None
    metrics = Metrics(name)
    core, conn = start_core(bundle_path, executor, dist_timeout_s)
    validator = Engine([], engine_layout(bundle))  # buckets and blocks only, no graphs
    client = EngineClient(core, conn, validator, tokenizer, metrics, max_waiting)
    try:
        client.start()
        api = create_app(App(bundle, tokenizer, client, metrics, name, api_key))
        config = uvicorn.Config(api, host=host, port=port, log_level="warning", access_log=False)
        print(f"neffkit: serving {name!r} at http://{host}:{port}/v1", flush=True)
        uvicorn.Server(config).run()
    finally:
        client.stop()
