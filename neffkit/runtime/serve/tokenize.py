"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt or a chat's rendered
template to the bundle's token ids (with the count and the context limit, what eval and RAG
tooling budgets by), and token ids back to text.

A text or a conversation tokenizes on a worker thread (a prompt of megabytes takes seconds); ids
outside the vocabulary, a missing or doubled input and a bundle without a tokenizer are 400s that
name the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request

from neffkit.errors import RequestError
from neffkit.runtime.serve.lora import LoraServer, adapter_of
from neffkit.runtime.serve.protocol import check_model
from neffkit.runtime.serve.request_constraints import parse_messages
from neffkit.runtime.serve.tool_prompt import for_template
from neffkit.runtime.tokenizer import Tokenizer

TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_generation_prompt",
        "add_special_tokens",
        "tools",
        "return_token_strs",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


class TokenizeServer(LoraServer, Protocol):
    """What of the server's state (app.py's App) the routes need."""

    tokenizer: Tokenizer | None


@dataclass(frozen=True)
class Tokenized:
    tokens: list[int]
    token_strs: list[str] | None


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false", param=name)
    return value


def _tokenizer(s: TokenizeServer, param: str) -> Tokenizer:
    if s.tokenizer is None:
        raise RequestError(f"this bundle has no tokenizer to read {param} with", param=param)
    return s.tokenizer


def tokenize(s: TokenizeServer, body: dict[str, Any], served: str) -> Tokenized:
    """A prompt's ids (special tokens added by default), or a conversation's through the chat
    template (a generation prompt by default; special tokens only where asked: the template
    writes its own), as vLLM's TokenizeCompletionRequest and TokenizeChatRequest."""
    adapter_of(s, check_model(body, served))  # the served model or an adapter (the same ids)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("give prompt or messages (exactly one)", param="prompt")
    strs = _flag(body, "return_token_strs", False)
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise RequestError("prompt must be a string", param="prompt")
        tok = _tokenizer(s, "prompt")
        ids = tok.encode(body["prompt"], _flag(body, "add_special_tokens", True))
    else:
        messages, tok = parse_messages(body), _tokenizer(s, "messages")
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError("tools must be a list of objects", param="tools")
        generation = _flag(body, "add_generation_prompt", True)
        messages, given = for_template(messages, tools, tok.chat_template)  # as chat renders
        text = tok.render_chat(messages, given, add_generation_prompt=generation)
        ids = tok.encode(text, _flag(body, "add_special_tokens", False))
    return Tokenized(ids, [tok.decode([i]) for i in ids] if strs else None)


def detokenize(s: TokenizeServer, body: dict[str, Any], served: str) -> str:
    adapter_of(s, check_model(body, served))
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise RequestError("tokens must be a list of token ids", param="tokens")
    vocab = s.loop.config.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return _tokenizer(s, "tokens").decode(ids)


def add_tokenize(api: FastAPI, s: TokenizeServer) -> None:
    @api.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        out = await s.parse(request, TOKENIZE_FIELDS, lambda b, m: tokenize(s, b, m))
        return {
            "count": len(out.tokens),
            "max_model_len": s.loop.max_model_len,
            "tokens": out.tokens,
            "token_strs": out.token_strs,
        }

    @api.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return {
            "prompt": await s.parse(request, DETOKENIZE_FIELDS, lambda b, m: detokenize(s, b, m))
        }
