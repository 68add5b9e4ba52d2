"""`POST /v1/embeddings`, as OpenAI and vLLM serve it, over an embed bundle (`task: embed`).

`input` is a text, a list of texts, a list of token ids or a list of such lists; each becomes
one request to the engine, which packs the waiting ones into its prefill calls (so the inputs of
one request, and of concurrent ones, are computed together) and runs an input longer than the
largest prefill bucket in chunks. `encoding_format` "float" answers lists of numbers, "base64"
the little-endian float32 bytes (what OpenAI's Python client asks for by default). A generate
bundle answers 400 here, and an embed bundle 400 on the generating routes (engine/limits.py).
"""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from neffkit.errors import RequestError
from neffkit.runtime.engine.core_client import Event
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.sampling_params import EMBED
from neffkit.runtime.serve.lora import LoraServer, adapter_of
from neffkit.runtime.serve.protocol import ApiRequest, check_model
from neffkit.runtime.tokenizer import Tokenizer

EMBEDDING_FIELDS = frozenset(
    {"model", "input", "encoding_format", "dimensions", "user", "add_special_tokens"}
)
MAX_INPUTS = 2048  # OpenAI's limit on inputs a request
ENCODINGS = ("float", "base64")


class EmbeddingServer(LoraServer, Protocol):
    """What of the server's state (app.py's App) the route needs."""

    tokenizer: Tokenizer | None

    def submit(self, parsed: ApiRequest, prompts: list[list[int]]) -> Any: ...

    async def collect(self, request: Request, choices: Any) -> list[Event]: ...


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    prompts: list[list[int]]
    encoding: str


def _inputs(value: Any) -> list[str | list[int]]:
    """`input` as a list of texts or token-id lists (400 naming it otherwise)."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(type(v) is int for v in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError(
            "input must be a string, a list of strings, a list of token ids or a list of such "
            "lists (not empty)",
            param="input",
        )
    for item in value:
        ok = isinstance(item, str) or (isinstance(item, list) and all(type(i) is int for i in item))
        if not ok:
            raise RequestError(
                "input must be a string, a list of strings, a list of token ids or a list of "
                "such lists",
                param="input",
            )
        if not item:
            raise RequestError("input: an input is empty", param="input")
    return value


def parse_embedding(s: EmbeddingServer, body: dict[str, Any], served: str) -> EmbeddingRequest:
    """The body checked and its inputs tokenized (on a worker thread: App.parse)."""
    model = check_model(body, served)
    adapter_of(s, model)  # the served model, else a 404 (an embed bundle has no adapters)
    pooling = s.loop.config.layout.pooling
    if pooling is None:
        raise RequestError(
            "this bundle generates text (task: generate); it computes no embeddings",
            hint="serve a bundle built with task: embed",
            param="model",
        )
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise RequestError("encoding_format must be float or base64", param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (type(dims) is not int or dims != pooling.width):
        raise RequestError(
            f"dimensions: this model's embeddings have {pooling.width} values (and are not "
            "truncated)",
            param="dimensions",
        )
    if not isinstance(body.get("user", ""), str):
        raise RequestError("user must be a string", param="user")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise RequestError("add_special_tokens must be true or false", param="add_special_tokens")
    inputs = _inputs(body.get("input"))
    limit = min(MAX_INPUTS, s.loop.max_waiting)
    if len(inputs) > limit:
        raise RequestError(
            f"input: {len(inputs)} inputs; at most {limit} a request here",
            hint="split the request (the server's --max-waiting bounds it too)",
            param="input",
        )
    prompts = [_ids(s, item, special) for item in inputs]
    for ids in prompts:
        check_fits(s.loop.config, ids, EMBED)
    return EmbeddingRequest(model, prompts, encoding)


def _ids(s: EmbeddingServer, item: str | list[int], special: bool) -> list[int]:
    if isinstance(item, list):
        return item
    if s.tokenizer is None:
        raise RequestError("this bundle has no tokenizer: send input as token ids", param="input")
    return s.tokenizer.encode(item, special)


def _encoded(vector: Any, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def add_embeddings(api: FastAPI, s: EmbeddingServer) -> None:
    @api.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        parsed = await s.parse(request, EMBEDDING_FIELDS, lambda b, m: parse_embedding(s, b, m))
        api_request = ApiRequest(
            prompts=list(parsed.prompts),
            messages=None,
            params=EMBED,
            stop=(),
            stream=False,
            include_usage=False,
            model=parsed.model,
        )
        events = await s.collect(request, s.submit(api_request, parsed.prompts))
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(e.embedding, parsed.encoding)}
            for i, e in enumerate(events)
        ]
        tokens = sum(map(len, parsed.prompts))
        return JSONResponse(
            {
                "id": f"embd-{secrets.token_hex(12)}",
                "object": "list",
                "created": int(time.time()),
                "model": parsed.model,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
