"""The request fields that shape the logits, parsed: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields into one StructuredSpec; `logit_bias`;
`tools` and `tool_choice` (tools.py turns them into a constraint and parses calls back), and the
chat messages that carry earlier tool calls and their results.

Exactly one constraint may be given; a malformed one is a RequestError naming its field. The
grammar itself is compiled later (structured.py), where a source that does not compile is a 400
naming the same field. Imports no torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from neffkit.errors import RequestError
from neffkit.runtime.sampling_params import (
    INT64_MAX,
    LOGIT_BIAS_LIMIT,
    StructuredSpec,
    is_int,
    shown,
)
from neffkit.runtime.serve.reasoning import END as REASONING_END
from neffkit.runtime.tokenizer import Tokenizer

_TOKEN_KEY = re.compile(r"-?[0-9]{1,19}")  # a token id as OpenAI's logit_bias keys spell it


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object (or, vLLM's guided_json, as JSON text)."""
    try:
        value = json.loads(value) if isinstance(value, str) else value
        text = json.dumps(value) if isinstance(value, dict | bool) else None
    except (ValueError, RecursionError) as exc:  # an integer too long, nesting too deep
        raise RequestError(f"{field} is not valid JSON: {exc}", param=field) from None
    if text is None:
        raise RequestError(f"{field} must be a JSON schema object", param=field)
    return text


def _one(kind: str, value: Any, field: str) -> StructuredSpec:
    """One constraint of a kind from its request value."""
    if kind == "json":
        return StructuredSpec("json", _schema_text(value, field), field)
    if kind == "json_object":
        return StructuredSpec("json", '{"type": "object"}', field)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise RequestError(f"{field} must be a non-empty list of strings", param=field)
        return StructuredSpec("choice", json.dumps(value), field)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{field} must be a non-empty string", param=field)
    return StructuredSpec(kind, value, field)


def _response_format(value: Any) -> StructuredSpec | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError(f"{field} must be an object with a type", param=field)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _one("json_object", None, field)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError(f"{field}.json_schema must be an object with a schema", param=field)
        return _one("json", spec["schema"], field)
    raise RequestError(
        f"{field}.type {kind!r} is not supported; use text, json_object or json_schema", param=field
    )


GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value: Any) -> StructuredSpec | None:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be an object", param=field)
    unknown = sorted(set(value) - set(STRUCTURED_KEYS) - {"disable_any_whitespace"})
    if unknown:
        raise RequestError(
            f"{field}.{unknown[0]} is not supported; one of {', '.join(STRUCTURED_KEYS)}",
            param=field,
        )
    given = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise RequestError(f"{field}: give one of {', '.join(given)}", param=field)
    return _one(given[0], value[given[0]], field) if given else None


def any_whitespace(body: dict[str, Any]) -> bool | None:
    """Not vLLM's structured_outputs.disable_any_whitespace (for whichever field gave a schema);
    None when the request leaves it to the server."""
    value = body.get("structured_outputs")
    compact = value.get("disable_any_whitespace") if isinstance(value, dict) else None
    if compact is not None and not isinstance(compact, bool):
        raise RequestError(
            "structured_outputs.disable_any_whitespace must be true or false",
            param="structured_outputs",
        )
    return None if compact is None else not compact


def parse_constraint(body: dict[str, Any]) -> StructuredSpec | None:
    """The request's output constraint, from whichever single field gives one."""
    found: list[StructuredSpec] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        found += [spec] if spec else []
    if body.get("structured_outputs") is not None:
        spec = _structured_outputs(body["structured_outputs"])
        found += [spec] if spec else []
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append(_one(kind, body[name], name))
    if len(found) > 1:
        fields = ", ".join(s.field for s in found)
        raise RequestError(
            f"only one output constraint per request; got {fields}", param=found[1].field
        )
    return replace(found[0], any_whitespace=any_whitespace(body)) if found else None


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} → sorted (id, bias) pairs, finite biases clamped to [-100, 100] and the
    last of keys naming one id kept (vLLM); a key that is not a decimal token id in [0, 2**63)
    or a bias that is not a finite number is a 400 (the vocabulary: limits.check_fits)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError("logit_bias must be an object of token id → bias", param="logit_bias")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and _TOKEN_KEY.fullmatch(key) else -1
        if not 0 <= token <= INT64_MAX:
            raise RequestError(
                f"logit_bias: key {shown(key)} is not a token id (a decimal integer >= 0)",
                param="logit_bias",
            )
        if not (is_int(bias) or isinstance(bias, float) and math.isfinite(bias)):
            raise RequestError(
                f"logit_bias[{shown(key)}] must be a finite number, got {shown(bias)}",
                param="logit_bias",
            )
        # compared before float(): an integer bias may be too large for a float
        biases[token] = float(max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, bias)))
    return tuple(sorted(biases.items()))


@dataclass(frozen=True)
class ToolRequest:
    """`tools` and what `tool_choice` asks of them: "auto", "required" or a function's name."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the function tool_choice names
    parallel: bool = True  # OpenAI's parallel_tool_calls: false allows one call (required)


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """None when no tools are given or tool_choice is "none" (the template still sees them)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(fn, dict)
            or tool.get("type") != "function"
            or not isinstance(fn.get("name"), str)
        ):
            raise RequestError(
                f"tools[{i}] must be {{type: function, function: {{name, ...}}}}", param="tools"
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(
                f"tools[{i}].function.parameters must be a JSON schema object", param="tools"
            )
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", "required", "none"):
        return None if choice == "none" else ToolRequest(tuple(tools), choice, None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise RequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in [t["function"]["name"] for t in tools]:
        raise RequestError(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return ToolRequest(tuple(tools), "named", name, parallel)


ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat's messages as role/content pairs: content parts joined into one text, and each
    message's tool calls or tool result id kept for the template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role", param="messages")
        if m["role"] not in ROLES:
            raise RequestError(
                f"messages[{i}].role: {shown(m['role'])} is not a chat role; roles: "
                f"{', '.join(ROLES)}",
                param="messages",
            )
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            texts = [p.get("text", "") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise RequestError(
                    f"messages[{i}].content parts must be objects with a text string",
                    param="messages",
                )
            content = "".join(texts)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", param="messages")
        flat.append({"role": m["role"], "content": content, **_tool_fields(m, i)})
    return flat


def _tool_fields(message: dict[str, Any], i: int) -> dict[str, Any]:
    """An assistant's earlier tool calls and a tool result's id, for the chat template; call
    arguments given as JSON text become objects, as templates expect (vLLM does the same)."""
    out = {k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)}
    calls = message.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise RequestError(f"messages[{i}].tool_calls must be a list of objects", param="messages")
    parsed = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except (ValueError, RecursionError):
                pass  # a template that wants text gets text (not JSON, or not readable)
        parsed.append({**c, "function": fn})
    return out | {"tool_calls": parsed}


def check_parsers(
    tools: ToolRequest | None,
    structured: StructuredSpec | None,
    parsers: tuple[str | None, str | None],
    tokenizer: Tokenizer | None,
) -> StructuredSpec | None:
    """A 400 for what the server's (tool, reasoning) parsers cannot follow: tool choice auto
    without a tool parser. A grammar (structured outputs, a required or named tool) under a
    reasoning parser applies once the reasoning ends, as vLLM's does: the constraint returned
    waits for `</think>`, which must then be one token of the bundle's tokenizer."""
    tool_parser, reasoning_parser = parsers
    if tools is not None and tools.choice == "auto" and tool_parser is None:
        raise RequestError(
            'tool_choice "auto" needs the server started with --tool-call-parser',
            hint="start with --tool-call-parser hermes (or llama3_json), or send "
            'tool_choice "required" or a named function',
            param="tool_choice",
        )
    if reasoning_parser is None or structured is None:
        return structured
    end = tokenizer.token_id(REASONING_END) if tokenizer is not None else None
    if end is None:
        raise RequestError(
            f"{structured.field}: a constrained output after the reasoning needs "
            f"{REASONING_END} to be one token of this bundle's tokenizer (--reasoning-parser "
            f"{reasoning_parser})",
            hint='leave the constraint out, or send tool_choice "auto"',
            param=structured.field,
        )
    return replace(structured, after_token=end)
