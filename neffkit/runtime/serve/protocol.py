"""The OpenAI request bodies: /v1/completions and /v1/chat/completions parsed into ApiRequests
(the prompt not yet encoded) and their SamplingParams (sampling_params.py).

The one place where an HTTP request is validated. Errors are RequestErrors carrying the field in
`param`, which the server turns into a 400 with an OpenAI error body. Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

from neffkit.errors import RequestError
from neffkit.runtime.sampling_params import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
    StructuredSpec,
    check_int,
    is_int,
    shown,
)
from neffkit.runtime.serve.request_constraints import (
    GUIDED,
    ToolRequest,
    any_whitespace,
    parse_constraint,
    parse_logit_bias,
    parse_messages,
    parse_tools,
)
from neffkit.runtime.serve.tools import tool_constraint

MAX_CHOICES = 64  # prompts × n in one request (each holds its own KV blocks)
# OpenAI/vLLM request fields this server does not implement (yet): a request that sets one to
# anything but its no-op value gets a 400 naming it, never a silently different answer.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}
# Every field each endpoint reads (or refuses by name above); any other is unknown to the server:
# logged as ignored, or refused under --strict-requests (access.py).
_COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "include_stop_str_in_output",
    "n",
    "logprobs",
    "top_logprobs",
    "echo",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "priority",
    "response_format",
    "structured_outputs",
    *GUIDED,
    *UNSUPPORTED,
)
COMPLETION_FIELDS = frozenset((*_COMMON_FIELDS, "prompt"))
CHAT_FIELDS = frozenset(
    (
        *_COMMON_FIELDS,
        "messages",
        "max_completion_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    )
)


# ---------------------------------------------------------------- OpenAI request bodies


@dataclass(frozen=True, kw_only=True)
class ApiRequest:
    """A parsed /v1/completions or /v1/chat/completions body (the prompt not yet encoded); built
    by keyword only."""

    prompts: list[str | list[int]]  # completions: one or more prompts, text or token ids
    # chat: role/content pairs, content flattened (and tool calls / results, for the template)
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    n: int = 1  # choices per prompt (distinct seeds)
    echo: bool = False  # completions: the prompt precedes the text (and its logprobs, if asked)
    return_token_ids: bool = False  # vLLM's: each choice also carries its prompt and output ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens "token_id:N"
    tools: tuple[dict[str, Any], ...] = ()  # chat: rendered by the template (tool_choice none too)
    tool_request: ToolRequest | None = None  # chat: what tool_choice asks (tools.py)
    model: str = ""  # the `model` asked for: the served one, or an adapter's name
    priority: int = 0  # --scheduling-policy priority: lower first (vLLM's)


def _huge_int(text: str) -> int | float:
    """A JSON integer; one too long for Python to read (over 4300 digits) is ±infinity, as json
    reads 1e400, so the field that holds it refuses it by name."""
    try:
        return int(text)
    except ValueError:
        return float("-inf") if text.startswith("-") else float("inf")


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError:  # an integer too long to read: again, with those as infinities
        return json.loads(raw, parse_int=_huge_int)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object, or a 400. JSON's numbers reach the fields as Python reads them: 1e400 and
    NaN / Infinity (which Python's json writes) as floats, -0 as 0, each field checks its own."""
    try:
        body = _loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # app.py's _shallow says the same of what walks the body later
        raise RequestError("request body is nested too deeply to read") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is never a valid number here
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join("number" if k is float else k.__name__ for k in kinds)
        got = shown(value, json.dumps(value))
        raise RequestError(f"{name} must be {names}, got {got}", param=name)
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = _get(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:  # a JSON integer too large for a float
        raise RequestError(f"{name} is out of range, got {shown(value)}", param=name) from None


def check_unsupported(body: dict[str, Any], also: dict[str, tuple[object, ...]]) -> None:
    for name, no_ops in {**UNSUPPORTED, **also}.items():
        if name in body and not any(
            body[name] == v and type(body[name]) is type(v) or body[name] is v for v in no_ops
        ):
            raise RequestError(
                f"{name} is not supported by this server; omit it (got {json.dumps(body[name])})",
                param=name,
            )


def check_model(body: dict[str, Any], served: str) -> str:
    """The model asked for (a string; left out: the served one). Whether the server has it (the
    served model or a loaded adapter, else a 404) is the server's to say."""
    return _get(body, "model", (str,), served)


def _sampling(
    body: dict[str, Any],
    max_tokens_field: str,
    default_max_tokens: int | None,
    logprobs: tuple[int | None, int | None],
    constraint: StructuredSpec | None,
) -> SamplingParams:
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    try:
        return SamplingParams(
            presence_penalty=_float(body, "presence_penalty", 0.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            repetition_penalty=_float(body, "repetition_penalty", 1.0),
            logit_bias=parse_logit_bias(body.get("logit_bias")),
            min_tokens=_get(body, "min_tokens", (int,), 0),
            structured=constraint,
            max_tokens=_get(body, max_tokens_field, (int,), default_max_tokens),
            temperature=_float(body, "temperature", DEFAULT_TEMPERATURE),
            top_k=_get(body, "top_k", (int,), DEFAULT_TOP_K),
            top_p=_float(body, "top_p", DEFAULT_TOP_P),
            seed=_get(body, "seed", (int,), None),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_get(body, "ignore_eos", (bool,), False),
            logprobs=logprobs[0],
            prompt_logprobs=logprobs[1],
        )
    except RequestError as exc:  # chat names its length field max_completion_tokens
        if exc.param == "max_tokens" and max_tokens_field != "max_tokens":
            exc = RequestError(
                exc.message.replace("max_tokens", max_tokens_field), param=max_tokens_field
            )
        raise exc from None


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    """Up to MAX_STOP_STRINGS strings of up to MAX_STOP_STRING_CHARS characters (empty ones are
    ignored, as the detokenizer drops them)."""
    value = body.get("stop")
    if value is None:
        return ()
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(v, str) for v in stop):
        raise RequestError("stop must be a string or a list of strings", param="stop")
    longest = max(map(len, stop), default=0)
    if len(stop) > MAX_STOP_STRINGS or longest > MAX_STOP_STRING_CHARS:
        raise RequestError(
            f"stop: at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} "
            f"characters each; got {len(stop)}, the longest of {longest}",
            param="stop",
        )
    return tuple(stop)


def _include_stop(body: dict[str, Any]) -> bool:
    return _get(body, "include_stop_str_in_output", (bool,), False)


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise RequestError(
            "stream_options.include_usage must be true or false", param="stream_options"
        )
    return stream, bool(include_usage)


def _is_prompt(value: Any) -> TypeGuard[str | list[int]]:
    return isinstance(value, str) or (
        isinstance(value, list) and bool(value) and all(map(is_int, value))
    )


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """A string, a list of token ids, or a list of either (one choice per prompt); ids within
    int64 here, within the vocabulary in limits.check_fits."""
    prompt = body.get("prompt")
    if prompt == []:
        return [[]]
    if _is_prompt(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(map(_is_prompt, prompt)):
        prompts = list(prompt)
    else:
        raise RequestError(
            "prompt must be a string, a list of token ids, or a list of strings or token-id lists",
            param="prompt",
        )
    for ids in prompts:
        if isinstance(ids, list) and not INT64_MIN <= min(ids) <= max(ids) <= INT64_MAX:
            bad = next(t for t in ids if not INT64_MIN <= t <= INT64_MAX)
            raise RequestError(
                f"prompt: token id {shown(bad)} is outside the vocabulary (and int64)",
                param="prompt",
            )
    return prompts


def _n(body: dict[str, Any], prompts: int) -> int:
    n = _get(body, "n", (int,), 1)
    if n < 1 or n * prompts > MAX_CHOICES:
        raise RequestError(
            f"n must be at least 1, with at most {MAX_CHOICES} choices per request "
            f"({prompts} prompt(s) × n = {n * prompts})",
            param="n",
        )
    return n


def parse_completion(body: dict[str, Any], served: str) -> ApiRequest:
    """A /v1/completions body. `logprobs: N` returns each token's logprob and the N most likely
    alternatives; with `echo`, the prompt's tokens too (the first one has none)."""
    model = check_model(body, served)
    check_unsupported(body, {"top_logprobs": (None,)})
    prompts = _prompts(body)
    top = _get(body, "logprobs", (int,), None)
    echo = _get(body, "echo", (bool,), False)
    logprobs = (top, top if echo else None)
    params = _sampling(body, "max_tokens", DEFAULT_MAX_TOKENS, logprobs, parse_constraint(body))
    stop = _stop(body)
    stream, include_usage = _stream_flags(body)
    include_stop, n = _include_stop(body), _n(body, len(prompts))
    return_token_ids, tokens_as_ids = _id_flags(body)
    return ApiRequest(
        prompts=prompts,
        messages=None,
        params=params,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        include_stop=include_stop,
        n=n,
        echo=echo,
        return_token_ids=return_token_ids,
        tokens_as_ids=tokens_as_ids,
        model=model,
        priority=_priority(body),
    )


def _priority(body: dict[str, Any]) -> int:
    """vLLM's `priority`: any 64-bit integer (whether the server's policy takes one is the
    engine's to say)."""
    value = _get(body, "priority", (int,), 0)
    check_int(value, "priority", INT64_MIN)
    return int(value)


def _id_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    return (
        _get(body, "return_token_ids", (bool,), False),
        _get(body, "return_tokens_as_token_ids", (bool,), False),
    )


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's spelling: `logprobs: true` and `top_logprobs: N` alternatives (needs logprobs)."""
    wanted = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), None)
    if top is not None and not wanted:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if top is not None:
        check_int(top, "top_logprobs")
    return (top or 0) if wanted else None


def parse_chat(body: dict[str, Any], served: str) -> ApiRequest:
    model = check_model(body, served)
    check_unsupported(body, {"echo": (None, False)})  # vLLM's chat echo is another feature
    flat = parse_messages(body)
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    logprobs = (_chat_logprobs(body), None)
    tools = parse_tools(body)
    constraint = parse_constraint(body)
    forced = tool_constraint(tools) if tools is not None else None
    if forced is not None:
        forced = replace(forced, any_whitespace=any_whitespace(body))
    if forced is not None and constraint is not None:
        raise RequestError(
            f"tool_choice {body['tool_choice']!r} and {constraint.field} both "
            "constrain the output; give one",
            param="tool_choice",
        )
    # chat: up to the context limit, as vLLM
    params = _sampling(body, field, None, logprobs, forced or constraint)
    stop = _stop(body)
    stream, include_usage = _stream_flags(body)
    include_stop, n = _include_stop(body), _n(body, 1)
    return_token_ids, tokens_as_ids = _id_flags(body)
    return ApiRequest(
        prompts=[],
        messages=flat,
        params=params,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        include_stop=include_stop,
        n=n,
        return_token_ids=return_token_ids,
        tokens_as_ids=tokens_as_ids,
        tools=tuple(body.get("tools") or ()),
        tool_request=tools,
        model=model,
        priority=_priority(body),
    )
