"""The OpenAI-compatible FastAPI application over a running engine client (FastAPI, as vLLM
serves): the App state, what each request goes through, the error bodies and the routes. The
process around it (bundle, engine core, uvicorn, shutdown) is api_server.py's.

Requests are parsed and validated in protocol.py, checked against the bundle's buckets and sent
to the engine core by core_client.py; this module turns their events into responses.

POST /v1/completions and /v1/chat/completions (SSE streaming with `data: [DONE]`, `usage`,
`stream_options.include_usage`; `model` names the served model or a LoRA adapter, lora.py, which
also adds the adapter routes), GET /v1/models, /health, /version, /metrics (Prometheus, vLLM
names). Bad requests get a 400 with an OpenAI-style error body naming the field, a model not
served a 404; a full waiting queue gets a 503. A client that disconnects mid-request has its
sequence and KV blocks freed. `api_key` requires `Authorization: Bearer KEY` on every route but
/health (access.py), and a body over `max_request_bytes` gets a 413. What costs CPU in proportion
to a request's size (parsing its JSON, its fields, tokenizing its prompts and checking their
length) runs on worker threads, so a large request never stalls the event loop: /health and
other streams keep answering.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import neffkit
from neffkit.contract.bundle import Bundle
from neffkit.errors import RequestError
from neffkit.runtime.engine.core_client import EngineDead, Event, ServerBusy, Stream
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.engine.metrics import Exposition
from neffkit.runtime.engine.structured import GrammarLimits, Grammars
from neffkit.runtime.serve.access import (
    REQUEST_ID,
    AccessLog,
    ApiKey,
    BodyRefused,
    HttpLimits,
    UnknownFields,
    add_http_errors,
    error_body,
    read_body,
)
from neffkit.runtime.serve.embeddings import add_embeddings
from neffkit.runtime.serve.engine_api import ServingEngine
from neffkit.runtime.serve.lora import adapter_of, add_lora, model_cards
from neffkit.runtime.serve.openai_responses import (
    RESPONSES_FIELDS,
    ResponsesShape,
    Shape,
    ShapeKind,
    make_shape,
    parse_responses,
)
from neffkit.runtime.serve.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ApiRequest,
    parse_body,
    parse_chat,
    parse_completion,
)
from neffkit.runtime.serve.request_constraints import check_parsers
from neffkit.runtime.serve.responses import ChatChunks, CompletionChunks, merge_events
from neffkit.runtime.serve.tokenize import add_tokenize
from neffkit.runtime.serve.tool_prompt import for_template
from neffkit.runtime.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.5
T = TypeVar("T")
ParseBody = Callable[[dict[str, Any], str], T]  # a body and the served model's name


# ---------------------------------------------------------------- the app


CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before its answer


class ClientGone(Exception):
    """The client disconnected while its whole-response request ran: its sequences are aborted
    (their KV blocks freed) and the request ends quietly, not as a server error."""


class App:
    """The server's state over one engine client, and each request's life: its prompts encoded,
    its constraints checked, its choices submitted, its answer whole or streamed."""

    def __init__(
        self,
        *,
        bundle: Bundle,
        tokenizer: Tokenizer | None,
        engine_loop: ServingEngine,
        metrics: Exposition,
        model_name: str,
        api_key: str | None = None,
        strict_requests: bool = False,
        access_log: bool = True,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        compact_json: bool = False,
        grammar_limits: GrammarLimits | None = None,
        max_request_bytes: int = HttpLimits.max_request_bytes,
        public_metrics: bool = False,
        lora_parents: dict[str, str] | None = None,
        runtime_lora: bool = False,
    ) -> None:
        """`lora_parents`: the base model an adapter names (`--lora-modules`' base_model_name;
        unnamed: the served model); `runtime_lora`: the adapter load and unload routes."""
        self.loop, self.metrics = engine_loop, metrics
        self.lora_parents, self.runtime_lora = dict(lora_parents or {}), runtime_lora
        self.max_request_bytes, self.public_metrics = max_request_bytes, public_metrics
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.compact_json = compact_json  # JSON constraints without whitespace unless asked
        config = engine_loop.config
        self.grammars = Grammars.of(
            tokenizer, config.vocab_size, config.eos_token_ids, grammar_limits
        )
        self.unknown_fields, self.access_log = UnknownFields(strict_requests), access_log
        self.model_name, self.api_key = model_name, api_key
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.digest = bundle.digest

    async def parse(self, request: Request, known: frozenset[str], parse: ParseBody[T]) -> T:
        """The body read (415 unless JSON, 413 over the limit), then on a worker thread: its
        JSON parsed, its unknown fields logged or refused, its fields parsed."""
        raw = await read_body(request, self.max_request_bytes)
        request_id = request.scope.get(REQUEST_ID, "-")

        def work() -> T:
            body = parse_body(raw)
            self.unknown_fields.check(body, known, request_id)
            return parse(body, self.model_name)

        return await asyncio.to_thread(_shallow, work)

    def checked_prompts(self, request: ApiRequest) -> list[list[int]]:
        """Each prompt as token ids, each checked against the bundle (too long, ids outside the
        vocabulary: a 400) before it reaches the engine client, whose own check is then cheap.
        Run on a worker thread: a prompt of megabytes takes seconds to tokenize."""
        prompts = self.prompt_ids(request)
        for ids in prompts:
            check_fits(self.loop.config, ids, request.params)
        return prompts

    def prompt_ids(self, request: ApiRequest) -> list[list[int]]:
        """Each prompt as token ids: encoded text, given ids, or the rendered chat template."""
        param = "messages" if request.messages is not None else "prompt"
        if all(isinstance(p, list) for p in request.prompts) and request.messages is None:
            return [list(p) for p in request.prompts]  # type: ignore[arg-type]
        if self.tokenizer is None:
            raise RequestError(
                f"this bundle has no tokenizer: send {param} as token ids", param=param
            )
        if request.messages is not None:
            template = self.tokenizer.chat_template
            messages, tools = for_template(request.messages, request.tools, template)
            return [self.tokenizer.encode_chat(messages, tools)]
        return [p if isinstance(p, list) else self.tokenizer.encode(p) for p in request.prompts]

    async def check_constraints(self, parsed: ApiRequest) -> ApiRequest:
        """A 400 for what the engine could not follow: auto tool choice without a parser, a
        grammar that does not compile (compiled off the event loop, and cached)."""
        parsers = (self.tool_parser, self.reasoning_parser)  # after the reasoning, under one
        spec = check_parsers(parsed.tool_request, parsed.params.structured, parsers, self.tokenizer)
        if spec is None:
            return parsed
        if self.grammars is None:
            raise RequestError("structured outputs need the bundle's tokenizer", param=spec.field)
        if spec.any_whitespace is None:  # the server's default
            spec = replace(spec, any_whitespace=not self.compact_json)
        parsed = replace(parsed, params=replace(parsed.params, structured=spec))
        await asyncio.to_thread(self.grammars.check, spec)
        return parsed

    # ------------------------------------------------------------ running

    def submit(
        self, parsed: ApiRequest, prompts: list[list[int]], adapter: str | None = None
    ) -> Choices:
        """Every choice (prompt × n) to the engine, on one queue of (index, event); if one is
        refused, the ones already sent are aborted."""
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        choices = Choices(queue, sum(map(len, prompts)), parsed.n)
        try:
            for i, ids in enumerate(prompts):
                for j in range(parsed.n):
                    index = i * parsed.n + j
                    params = parsed.params  # distinct seeds for the n samples of one prompt
                    if j and params.seed is not None:  # (unseeded ones each get their own)
                        params = replace(params, seed=(params.seed + j) % 2**63)

                    def emit(event: Event, index: int = index) -> None:
                        loop.call_soon_threadsafe(queue.put_nowait, (index, event))

                    choices.streams.append(
                        self.loop.submit(
                            ids,
                            params,
                            parsed.stop,
                            emit,
                            parsed.include_stop,
                            adapter,
                            parsed.priority,
                        )
                    )
        except Exception:
            choices.abort(self.loop)
            raise
        return choices

    async def collect(self, request: Request, choices: Choices) -> list[Event]:
        """Wait for every choice's whole output; abort all if the client disconnects."""
        parts: list[list[Event]] = [[] for _ in choices.streams]
        done = 0
        while done < len(choices.streams):
            try:
                index, event = await asyncio.wait_for(choices.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    choices.abort(self.loop)
                    raise ClientGone() from None
                continue
            if event.finish_reason == "error":
                raise EngineDead(f"the engine failed: {event.text}")
            parts[index].append(event)
            done += event.finish_reason is not None
        return [merge_events(p) for p in parts]

    async def respond(self, request: Request, parsed: ApiRequest, kind: ShapeKind) -> Response:
        """Submit, then stream (SSE) or wait for the whole answer (its `model`: the one asked,
        an adapter's name as vLLM echoes it)."""
        adapter = adapter_of(self, parsed.model)
        parsed = await self.check_constraints(parsed)
        prompts = await asyncio.to_thread(_shallow, lambda: self.checked_prompts(parsed))
        choices = self.submit(parsed, prompts, adapter)
        parsers = (self.tool_parser, self.reasoning_parser)
        shape = make_shape(kind, parsed, self.tokenizer, prompts, parsers)
        if parsed.stream:
            return StreamingResponse(
                self.sse(choices, shape, parsed.include_usage), media_type="text/event-stream"
            )
        events = await self.collect(request, choices)
        return JSONResponse(shape.whole(events, choices.usage(events)))

    async def sse(self, choices: Choices, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
        """`data: {json}` per event, then usage (if asked), then `data: [DONE]`."""
        finished: dict[int, Event] = {}
        try:
            for index in range(len(choices.streams)):
                first = shape.first(index)
                if first:
                    yield f"data: {json.dumps(first)}\n\n"
            while len(finished) < len(choices.streams):
                index, event = await choices.queue.get()
                if event.finish_reason == "error":
                    error = {
                        "message": f"the engine failed: {event.text}",
                        "type": "engine_error",
                        "param": None,
                        "code": 500,
                    }
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    return
                for body in shape.chunks(index, event):
                    yield f"data: {json.dumps(body)}\n\n"
                if event.finish_reason is not None:
                    finished[index] = event
            if include_usage:
                events = [finished[i] for i in range(len(choices.streams))]
                yield f"data: {json.dumps(shape.usage(choices.usage(events)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if len(finished) < len(choices.streams):  # client gone or server stopping
                choices.abort(self.loop)


@dataclass
class Choices:
    """The engine streams of one request's choices, and the queue their events arrive on."""

    queue: asyncio.Queue[tuple[int, Event]]
    prompt_tokens: int  # each prompt counted once, whatever n
    n: int = 1  # choices per prompt
    streams: list[Stream] = field(default_factory=list)

    def abort(self, client: ServingEngine) -> None:
        for stream in self.streams:
            client.abort(stream)

    def usage(self, events: list[Event]) -> dict[str, Any]:
        """OpenAI's usage; `cached_tokens` counts each prompt's first choice (as its tokens)."""
        completion = sum(e.completion_tokens for e in events)
        cached = sum(e.cached_tokens for e in events[:: self.n])
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _shallow(work: Callable[[], T]) -> T:
    """`work()`, with a body nested deeper than Python recurses a 400, not a 500: beside the
    JSON parser (100,000 `[`), whatever walks a value of the body (a template, a schema)."""
    try:
        return work()
    except RecursionError:
        raise RequestError(
            "request body is nested too deeply to process (arrays and objects within each "
            "other, more than Python's recursion limit allows)",
            hint="flatten the body",
        ) from None


def create_app(app_state: App) -> FastAPI:
    api = FastAPI(title="neffkit", version=neffkit.__version__, docs_url=None, redoc_url=None)
    _add_errors(api, app_state)
    add_http_errors(api)
    _add_routes(api, app_state)
    add_lora(api, app_state)
    add_tokenize(api, app_state)
    add_embeddings(api, app_state)
    if app_state.api_key:
        open_paths = {"/health", "/metrics"} if app_state.public_metrics else {"/health"}
        api.add_middleware(ApiKey, key=app_state.api_key, open_paths=frozenset(open_paths))
    api.add_middleware(AccessLog, log=app_state.access_log)  # outermost: every answer logged
    return api


def _add_errors(api: FastAPI, s: App) -> None:
    """Each error kind as an OpenAI error body with its status."""

    @api.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: the access log does

    @api.exception_handler(ServerBusy)
    async def busy(request: Request, exc: ServerBusy) -> Response:
        return error_body(exc.message, "server_busy", code=503)

    @api.exception_handler(EngineDead)
    async def engine_dead(request: Request, exc: EngineDead) -> Response:
        return error_body(exc.message, "engine_error", code=500)

    @api.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError) -> Response:
        hint = f" ({exc.own_hint})" if exc.own_hint else ""  # not the docs page: a client's
        return error_body(exc.message + hint, "invalid_request_error", exc.param)

    @api.exception_handler(BodyRefused)
    async def body_refused(request: Request, exc: BodyRefused) -> Response:
        message = f"{exc.message} ({exc.own_hint})" if exc.own_hint else exc.message
        return error_body(message, "invalid_request_error", code=exc.status)


def _add_routes(api: FastAPI, s: App) -> None:
    """The endpoints: health, version, metrics, models, completions and chat completions."""

    @api.get("/health")
    async def health() -> Response:
        if not s.loop.healthy:
            return PlainTextResponse("engine stopped", status_code=503)
        return PlainTextResponse(s.loop.status)  # "ok"; replicas: "degraded: ..." while one is down

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": neffkit.__version__, "bundle_digest": s.digest}

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/v1/models")
    async def models() -> Response:  # a JSONResponse: FastAPI builds no response model for it
        return JSONResponse({"object": "list", "data": model_cards(s)})

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await s.parse(request, COMPLETION_FIELDS, parse_completion)
        return await s.respond(request, parsed, CompletionChunks)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        parsed = await s.parse(request, CHAT_FIELDS, parse_chat)
        return await s.respond(request, parsed, ChatChunks)

    @api.post("/v1/responses")
    async def responses(request: Request) -> Response:
        parsed = await s.parse(request, RESPONSES_FIELDS, parse_responses)
        return await s.respond(request, parsed, ResponsesShape)
