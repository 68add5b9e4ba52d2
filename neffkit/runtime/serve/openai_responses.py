"""`POST /v1/responses`, the stateless subset vLLM serves: a Responses request read as the chat
request it amounts to (`input` and `instructions` as messages, `max_output_tokens`, `text.format`
as a structured output, flat function tools as chat's), run as one, and its answer written as a
Response object (`output`: the reasoning, the message, the function calls) or as the Responses
stream's events (`response.created`, `response.output_text.delta`…, `response.completed`).

Nothing is stored: `previous_response_id` and `store: true` are refused by name.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, TypeAlias

from neffkit.errors import RequestError
from neffkit.runtime.engine.core_client import Event
from neffkit.runtime.serve.protocol import ApiRequest, parse_chat
from neffkit.runtime.serve.responses import Body, ChatChunks, CompletionChunks, merge_events
from neffkit.runtime.tokenizer import Tokenizer

RESPONSES_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        "user",
        "truncation",
        "seed",
    }
)
# what a Responses field is called in chat completions
RENAMED = {"max_output_tokens": "max_completion_tokens"}
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "user", "seed")


def parse_responses(body: dict[str, Any], served: str) -> ApiRequest:
    """The chat request a Responses request amounts to (parsed and checked as chat's)."""
    if body.get("previous_response_id") is not None:
        raise RequestError(
            "previous_response_id: this server stores no responses; send the conversation as input",
            param="previous_response_id",
        )
    if body.get("store") is True:
        raise RequestError(
            "store: this server stores no responses (send store: false)", param="store"
        )
    if body.get("truncation", "disabled") != "disabled":
        raise RequestError("truncation: only disabled is supported", param="truncation")
    chat: dict[str, Any] = {k: body[k] for k in PASSED if k in body}
    chat |= {RENAMED[k]: body[k] for k in RENAMED if k in body}
    chat["messages"] = _messages(body)
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return parse_chat(chat, served)


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError(f"{param} must be a list", param=param)
    return value


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` as a system message, then `input`: a text (one user message) or messages
    whose content is a text or input_text / output_text parts."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", param="instructions")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    for i, item in enumerate(_list(given, "input")):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise RequestError(f"input[{i}] must be a message (role and content)", param="input")
        content = item.get("content")
        if isinstance(content, list):
            content = [
                {"type": "text", "text": p.get("text")} if isinstance(p, dict) else p
                for p in content
            ]
        out.append({"role": item.get("role"), "content": content})
    return out


def _response_format(fmt: Any) -> dict[str, Any]:
    """text.format as chat's response_format: json_schema's name and schema nest there."""
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", param="text")
    if fmt.get("type") != "json_schema":
        return fmt
    inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's (nested under `function`)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise RequestError(f"tools[{i}]: only function tools are supported", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


class ResponsesShape:
    """One request's Response object and stream events, over the chat shape that parses its
    reasoning and tool calls."""

    def __init__(self, chat: ChatChunks, prompt_tokens: int, model: str) -> None:
        self.chat, self.prompt_tokens, self.model = chat, prompt_tokens, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.events: list[Event] = []
        self._opened = False  # the message item and its text part announced

    def _response(self, status: str, output: list[Body], usage: Body | None) -> Body:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "incomplete_details": incomplete,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": usage,
        }

    def _output(self, e: Event) -> list[Body]:
        message, _ = self.chat._message(e)
        out: list[Body] = []
        if message.get("reasoning_content"):
            text = {"type": "reasoning_text", "text": message["reasoning_content"]}
            out.append(
                {"type": "reasoning", "id": f"rs_{self.id[5:]}", "summary": [], "content": [text]}
            )
        if message.get("content"):
            out.append(self._message_item(message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            out.append(
                {
                    "type": "function_call",
                    "id": f"fc_{call['id']}",
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": function["arguments"],
                    "status": "completed",
                }
            )
        return out

    def _message_item(self, text: str, status: str) -> Body:
        part = {"type": "output_text", "text": text, "annotations": []}
        content = [part] if status == "completed" else []
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def whole(self, events: list[Event], usage: Body) -> Body:
        e = events[0]
        status = "incomplete" if e.finish_reason == "length" else "completed"
        return self._response(status, self._output(e), _usage(usage))

    # ------------------------------------------------------------------ streamed
    def first(self, index: int) -> Body:
        return {"type": "response.created", "response": self._response("in_progress", [], None)}

    def chunks(self, index: int, e: Event) -> list[Body]:
        self.events.append(e)
        out = []
        for body in self.chat.chunks(index, e):
            delta = body["choices"][0]["delta"].get("content")
            if delta:
                if not self._opened:
                    out += self._open()
                out.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": self.message_id,
                        "output_index": 0,
                        "content_index": 0,
                        "delta": delta,
                    }
                )
        if e.finish_reason is not None:
            out += self._close()
        return out

    def _open(self) -> list[Body]:
        self._opened = True
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": self._message_item("", "in_progress"),
            },
            {
                "type": "response.content_part.added",
                "item_id": self.message_id,
                "output_index": 0,
                "content_index": 0,
                "part": part,
            },
        ]

    def _close(self) -> list[Body]:
        whole = merge_events(self.events)
        prompt, completion = self.prompt_tokens, len(whole.token_ids)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": whole.cached_tokens},
        }
        done = self.whole([whole], usage)
        text = "".join(
            p["text"]
            for item in done["output"]
            if item["type"] == "message"
            for p in item["content"]
        )
        out: list[Body] = []
        if self._opened:
            out.append(
                {
                    "type": "response.output_text.done",
                    "item_id": self.message_id,
                    "output_index": 0,
                    "content_index": 0,
                    "text": text,
                }
            )
        return [*out, {"type": "response.completed", "response": done}]

    def usage(self, usage: Body) -> Body:  # the stream's usage rides on response.completed
        return {"type": "response.usage", "usage": _usage(usage)}


# the bodies a request's answer is written in, and their classes
Shape: TypeAlias = CompletionChunks | ChatChunks | ResponsesShape
ShapeKind: TypeAlias = type[CompletionChunks] | type[ChatChunks] | type[ResponsesShape]


def _usage(usage: Body) -> Body:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def make_shape(
    kind: ShapeKind,
    parsed: ApiRequest,
    tokenizer: Tokenizer | None,
    prompts: list[list[int]],
    parsers: tuple[str | None, str | None],
) -> Shape:
    """The bodies a request's answer is written in: completions', chat's (with the server's
    tool and reasoning parsers), or a Response over chat's."""
    if kind is CompletionChunks:
        return CompletionChunks(parsed.model, tokenizer, parsed, prompts)
    chat = ChatChunks(parsed.model, tokenizer, parsed, prompts, *parsers)
    return chat if kind is ChatChunks else ResponsesShape(chat, len(prompts[0]), parsed.model)
