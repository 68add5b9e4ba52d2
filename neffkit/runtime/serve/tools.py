"""Tool calls, as vLLM's OpenAI server makes them: `tool_choice` "required" and a named function
become a JSON-schema constraint on the output (so the call is valid by construction); "auto"
leaves the model free and a parser for the model's format finds the calls in its text.

- required: the output is a JSON array of {"name", "parameters"} objects, one of the tools each
  (vLLM's schema, closed to other keys so a call ends after its parameters); finish_reason
  "tool_calls".
- named: the output is the function's arguments (its parameters schema); finish_reason "stop".
- auto: `hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen, Hermes,
  SmolLM3 and others) or `llama3_json` (a JSON object with "name" and "parameters", Llama 3.x),
  chosen by the server's --tool-call-parser; text outside the calls stays content.

`ToolStream` turns a choice's streamed text into deltas: content while it cannot be part of a
call, then each call as vLLM streams it (a delta with the id, type and name, then one with the
arguments). Imports no torch.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from neffkit.runtime.sampling_params import StructuredSpec
from neffkit.runtime.serve.reasoning import partial_tag
from neffkit.runtime.serve.request_constraints import ToolRequest

PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(req: ToolRequest) -> StructuredSpec | None:
    """The output constraint `tool_choice` implies (None for auto); its schema comes from the
    tools, so a schema that does not compile is blamed on them (`schema_field`)."""
    if req.choice == "named":
        tool = next(t for t in req.tools if t["function"]["name"] == req.name)
        return StructuredSpec("json", json.dumps(_parameters(tool)), "tool_choice", None, "tools")
    if req.choice == "required":
        items = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in req.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not req.parallel:
            schema["maxItems"] = 1
        return StructuredSpec("json", json.dumps(schema), "tool_choice", None, "tools")
    return None


def call(name: str, arguments: Any) -> dict[str, Any]:
    """One tool call of a response message (arguments as JSON text, OpenAI's form)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return text, []  # not a call after all: all of it is content (vLLM's rule)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(call(obj["name"], obj.get("arguments", {})))
    if not calls:
        return text, []
    content = text[: text.find(HERMES_START)].strip()
    return content or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix(LLAMA_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return None, calls


def parse_calls(
    req: ToolRequest, parser: str | None, text: str
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output as (content, tool calls)."""
    if req.choice == "named":
        assert req.name is not None
        return None, [call(req.name, text)]
    if req.choice == "required":
        try:
            found = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens: no calls, the text as content
            return text, []
        return None, [call(c["name"], c.get("parameters", {})) for c in found]
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3_json(text)
    return text, []


def finish_reason(req: ToolRequest, calls: list[dict[str, Any]], reason: str | None) -> str | None:
    """vLLM's: "tool_calls" when auto found calls or required ended normally."""
    if calls and (req.choice == "auto" or req.choice == "required" and reason == "stop"):
        return "tool_calls"
    return reason


def call_deltas(index: int, c: dict[str, Any]) -> list[dict[str, Any]]:
    """A call as two streamed deltas: id, type and name first, then the arguments."""
    fn = c["function"]
    head = {
        "index": index,
        "id": c["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": ""},
    }
    args = {"index": index, "function": {"arguments": fn["arguments"]}}
    return [{"tool_calls": [head]}, {"tool_calls": [args]}]


class ToolStream:
    """One choice's streamed text as content and tool-call deltas."""

    def __init__(self, req: ToolRequest, parser: str | None) -> None:
        self.req, self.parser = req, parser
        self.text = ""  # everything so far
        self.sent = 0  # characters of text already sent as content
        self.calls: list[dict[str, Any]] = []
        self._named_started = False

    def feed(self, new: str) -> list[dict[str, Any]]:
        """Deltas for new text (content that can no longer start a call, finished calls)."""
        self.text += new
        if self.req.choice == "named":  # the text is the arguments: stream them as they come
            deltas = []
            if not self._named_started:
                assert self.req.name is not None
                self.calls = [call(self.req.name, "")]
                head = call_deltas(0, self.calls[0])[0]
                deltas.append(head)
                self._named_started = True
            if new:
                self.calls[0]["function"]["arguments"] += new
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
            return deltas
        if self.req.choice == "auto" and self.parser == "hermes":
            return self._hermes_content()
        return []  # required, llama3_json: known only once the output is whole

    def _hermes_content(self) -> list[dict[str, Any]]:
        start = self.text.find(HERMES_START)
        upto = start if start >= 0 else len(self.text) - partial_tag(self.text, HERMES_START)
        if upto <= self.sent:
            return []
        delta = {"content": self.text[self.sent : upto]}
        self.sent = upto
        return [delta]

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The remaining deltas once the output is whole, and the choice's finish reason."""
        if self.req.choice == "named":
            return self.feed("") if not self._named_started else [], reason
        _, calls = parse_calls(self.req, self.parser, self.text)
        deltas: list[dict[str, Any]] = []
        end = len(self.text)
        if calls:  # content is what came before the first call (hermes), none otherwise
            end = max(self.text.find(HERMES_START), 0) if self.parser == "hermes" else 0
            end = end if self.req.choice == "auto" else 0
        rest = self.text[self.sent : end]
        if rest:
            deltas.append({"content": rest})
        for i, c in enumerate(calls):
            deltas += call_deltas(i, c)
        self.calls = calls
        return deltas, finish_reason(self.req, calls, reason)
