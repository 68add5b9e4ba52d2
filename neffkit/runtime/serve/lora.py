"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules` specs, a request's `model`
naming an adapter (a 404 for a model the server does not have), the adapters in /v1/models, and
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`, which exist only when
NEFFKIT_ALLOW_RUNTIME_LORA_UPDATING is true (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).

Names and paths come from a client: a name is 1 to 128 letters, digits and `._-/` (it becomes a
Prometheus label and part of messages), a path a directory, checked before the engine reads it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from neffkit.errors import AdapterError, NeffkitError, RequestError
from neffkit.runtime.engine.core_client import NotFound, unknown_model
from neffkit.runtime.sampling_params import shown
from neffkit.runtime.serve.access import error_body
from neffkit.runtime.serve.engine_api import ServingEngine

RUNTIME_UPDATING_ENV = "NEFFKIT_ALLOW_RUNTIME_LORA_UPDATING"
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
MAX_PATH_CHARS = 4096
LOAD_FIELDS = frozenset(("lora_name", "lora_path"))
UNLOAD_FIELDS = frozenset(("lora_name",))
_SPEC_KEYS = ("name", "path", "base_model_name")
T = TypeVar("T")


def runtime_updating() -> bool:
    """NEFFKIT_ALLOW_RUNTIME_LORA_UPDATING read as vLLM reads its variable: `1` or `true`."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry: served as `name`, read from `path`; `base_model_name` is the
    `parent` /v1/models shows (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def check_name(value: Any, param: str) -> str:
    """An adapter name: a string of 1 to 128 letters, digits and `._-/`, starting with a letter
    or a digit (RequestError naming `param`)."""
    if value is None:
        raise RequestError(f"{param} is required", param=param)
    if not isinstance(value, str):
        raise RequestError(f"{param} must be a string, got {shown(value)}", param=param)
    if not ADAPTER_NAME.fullmatch(value):
        raise RequestError(
            f"{param} {shown(value)} is not an adapter name: 1 to 128 letters, digits, '.', '_', "
            "'-' or '/', starting with a letter or a digit",
            param=param,
        )
    return value


def check_path(value: Any, param: str = "lora_path") -> str:
    """A PEFT adapter directory's path, as given (RequestError naming `param`)."""
    if value is None:
        raise RequestError(f"{param} is required", param=param)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a non-empty string, got {shown(value)}", param=param)
    if len(value) > MAX_PATH_CHARS or not value.isprintable():
        raise RequestError(
            f"{param}: a path of at most {MAX_PATH_CHARS} printable characters", param=param
        )
    if not os.path.isdir(os.path.expanduser(value)):  # never raises: False
        raise RequestError(
            f"{param} {shown(value)} is not a directory (a PEFT adapter is a save_pretrained "
            "directory)",
            param=param,
        )
    return value


def parse_lora_module(text: str) -> LoraModule:
    """`NAME=PATH`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`
    (NeffkitError: neither)."""
    text = text.strip()
    if not text.startswith("{"):
        name, sep, path = text.partition("=")
        if not sep or not path:
            raise NeffkitError(f"expected NAME=PATH or a JSON object, got {shown(text)}")
        return LoraModule(check_name(name, "name"), path)
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NeffkitError(f"not valid JSON ({exc}): {shown(text)}") from None
    if not isinstance(spec, dict) or set(spec) - set(_SPEC_KEYS):
        raise NeffkitError(f"expected a JSON object with keys among {', '.join(_SPEC_KEYS)}")
    where, base = spec.get("path"), spec.get("base_model_name")
    if not isinstance(where, str) or not where:
        raise NeffkitError(f"path must be a non-empty string, got {shown(where)}")
    if base is not None and not isinstance(base, str):
        raise NeffkitError(f"base_model_name must be a string, got {shown(base)}")
    return LoraModule(check_name(spec.get("name"), "name"), where, base)


def parse_load(body: dict[str, Any], served: str) -> LoraModule:
    """A /v1/load_lora_adapter body (run on a worker thread: the path is looked at)."""
    name = check_name(body.get("lora_name"), "lora_name")
    if name == served:
        raise RequestError(f"lora_name {name!r} is the served model's name", param="lora_name")
    return LoraModule(name, check_path(body.get("lora_path")))


def parse_unload(body: dict[str, Any], served: str) -> str:
    return check_name(body.get("lora_name"), "lora_name")


class LoraServer(Protocol):
    """What of the server's state (app.py's App) the adapters need."""

    loop: ServingEngine
    model_name: str
    created: int
    lora_parents: dict[str, str]
    runtime_lora: bool

    async def parse(
        self, request: Request, known: frozenset[str], parse: Callable[[dict[str, Any], str], T]
    ) -> T: ...


def adapter_of(s: LoraServer, model: str) -> str | None:
    """The adapter a request's `model` names (None: the served model); a 404 if neither."""
    if model == s.model_name:
        return None
    if model in s.loop.adapters:
        return model
    raise unknown_model(model)


def model_cards(s: LoraServer) -> list[dict[str, Any]]:
    """/v1/models' entries: the served model, then each adapter with its directory (`root`) and
    its base (`parent`), as vLLM lists them."""
    card = {"object": "model", "created": s.created, "owned_by": "neffkit"}
    length = {"max_model_len": s.loop.max_model_len}
    cards = [{"id": s.model_name, **card, **length}]
    for name, path in list(s.loop.adapters.items()):
        parent = s.lora_parents.get(name, s.model_name)
        cards.append({"id": name, **card, "root": path, "parent": parent, **length})
    return cards


def add_lora(api: FastAPI, s: LoraServer) -> None:
    """The 404 and adapter error bodies; with runtime updating, the load and unload routes."""

    @api.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> Response:  # vLLM's type
        return error_body(exc.message, "NotFoundError", exc.param, code=404)

    @api.exception_handler(AdapterError)
    async def bad_adapter(request: Request, exc: AdapterError) -> Response:
        return error_body(exc.message, "invalid_request_error", "lora_path")

    if not s.runtime_lora:
        return

    @api.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        module = await s.parse(request, LOAD_FIELDS, parse_load)
        await asyncio.wrap_future(s.loop.load_adapter(module.name, module.path))
        return PlainTextResponse(f"Success: LoRA adapter '{module.name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        name = await s.parse(request, UNLOAD_FIELDS, parse_unload)
        await asyncio.wrap_future(s.loop.unload_adapter(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
