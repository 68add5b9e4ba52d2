"""The tool-call parser `auto` picks from a chat template, and the tools a template without
them gets in its system message (serve/tool_prompt.py), rendered through a real template."""

from __future__ import annotations

import copy
import json

import pytest

from neffkit.runtime.serve import tool_prompt
from neffkit.runtime.serve.request_constraints import parse_messages
from tests.support.models import CHAT_TEMPLATE

# the tool-relevant lines of public templates, as they spell them
QWEN = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>"
LLAMA3 = "{% if tools is not none %}{{ '<|python_tag|>' }}{% endif %}"
MISTRAL = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("template", "architecture", "parser", "takes_tools"),
    [
        (QWEN, "Qwen3ForCausalLM", "hermes", True),
        (LLAMA3, "LlamaForCausalLM", "llama3_json", True),
        (MISTRAL, "LlamaForCausalLM", "llama3_json", True),
        (MISTRAL, "MistralForCausalLM", "hermes", True),
        (CHAT_TEMPLATE, "LlamaForCausalLM", "hermes", False),  # SmolLM2's kind: no tools
        (None, "LlamaForCausalLM", "hermes", False),
    ],
)
def test_auto_parser_follows_the_template(template, architecture, parser, takes_tools) -> None:
    assert tool_prompt.choose_parser(template, architecture) == parser
    assert tool_prompt.template_takes_tools(template) is takes_tools


def test_tools_go_into_the_system_message_and_history_into_text() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        ]
    }
    messages = parse_messages(body)  # as the server reads them (arguments: an object)
    before = copy.deepcopy(messages)
    out = tool_prompt.with_tools(messages, [WEATHER])
    assert out[0]["role"] == "system" and json.dumps(WEATHER) in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    body = out[2]["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert out[2]["role"] == "assistant" and json.loads(body) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    assert messages == before  # the request's messages are not changed
    with_system = tool_prompt.with_tools([{"role": "system", "content": "Be brief."}], [WEATHER])
    assert len(with_system) == 1 and with_system[0]["content"].startswith("Be brief.\n\n# Tools")
