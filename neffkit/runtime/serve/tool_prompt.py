"""Which tool-call parser a served model needs, and tools for a chat template without them.

`--tool-call-parser auto` (the default) reads the chat template, as a careful vLLM user picks
the parser for a model by hand:
- a template that writes `<tool_call>` (Qwen 2.5 and 3, Hermes, SmolLM3): hermes;
- one that writes `<|python_tag|>` or an `ipython` role (Llama 3.x): llama3_json;
- one that takes `tools` in another way: llama3_json for a Llama, else hermes;
- one that never mentions tools (SmolLM2, many fine-tunes): hermes, and the tools go into the
  conversation itself. Such a template renders tool definitions nowhere, so the model would
  never hear of them: the server says so once at startup and `with_tools` writes them into the
  system message in hermes's format (PREAMBLE, documented in docs/serving.md), past calls as
  `<tool_call>` text and tool results as `<tool_response>` user turns, as hermes templates do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

PREAMBLE = """# Tools

You may call one or more functions to help with the user's request. The functions are given \
within <tools></tools> XML tags:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object of its name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


def template_takes_tools(template: str | None) -> bool:
    """Does the chat template render a `tools` variable anywhere?"""
    return template is not None and re.search(r"\btools\b", template) is not None


def choose_parser(template: str | None, architecture: str) -> str:
    """`--tool-call-parser auto`: the parser a model's chat template implies."""
    text = template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    if template_takes_tools(template) and architecture.lower().startswith("llama"):
        return "llama3_json"
    return "hermes"


def _call_text(call: dict[str, Any]) -> str:
    """A past call as hermes's text; its arguments as parse_messages left them (an object, or
    the client's text where that is not JSON)."""
    fn = call.get("function", {})
    body = json.dumps(
        {"name": fn.get("name"), "arguments": fn.get("arguments")}, ensure_ascii=False
    )
    return f"<tool_call>\n{body}\n</tool_call>"


def with_tools(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with the tools in its system message (one added first where there is
    none), an assistant's calls as `<tool_call>` text and tool results as user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}".strip()})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append(dict(message))
    defs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    preamble = PREAMBLE.format(tools=defs)
    if out and out[0].get("role") in ("system", "developer"):
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{preamble}".strip()
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out


def for_template(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]], template: str | None
) -> tuple[list[dict[str, Any]], Sequence[dict[str, Any]]]:
    """What a chat template is given: the tools as they are where it takes them, else written
    into the conversation (`with_tools`)."""
    if tools and not template_takes_tools(template):
        return with_tools(messages, tools), ()
    return messages, tools
