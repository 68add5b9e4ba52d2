"""Request parsing and validation (runtime/serve/protocol.py): every bad field is a RequestError
naming it, never an exception of another kind (which the server would turn into a 500)."""

from __future__ import annotations

import json

import pytest

from neffkit.errors import RequestError
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.serve.protocol import parse_body, parse_chat, parse_completion
from tests.fake_model import fake_runner

OK = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": None}, None),  # null means the default
        ({"stream_options": None}, None),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63 - 1}, None),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 1e308}, "temperature"),  # beyond float32: the graphs read float32
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 2**64}, "top_k"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "logprobs": 1}, None),  # lm-eval's loglikelihood
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [1, None]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"n": 4, "prompt": ["a", "b"]}, None),
        ({"prompt": ["a", [1, 2]]}, None),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"logprobs": 2}, None),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": None}, None),
        ({"echo": True}, None),
        ({"echo": 1}, "echo"),
        ({"top_logprobs": 2}, "top_logprobs"),  # chat's field
        ({"presence_penalty": 0.5}, None),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": 0}, None),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1.3}, None),
        ({"logit_bias": {"5": 100}}, None),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"min_tokens": 4}, None),
        ({"min_tokens": 99}, "min_tokens"),  # above max_tokens
        ({"min_tokens": -1}, "min_tokens"),
        ({"response_format": {"type": "json_object"}}, None),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": "x", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"model": 5}, "model"),
    ],
)
def test_completion_fields(extra, param) -> None:
    body = {**OK, **extra}
    if param is None:
        parse_completion(body, "m")
        return
    with pytest.raises(RequestError) as err:
        parse_completion(body, "m")
    assert err.value.param == param, err.value.message


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"content": "hi"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": ["loose string"]}],
    ],
)
def test_chat_messages(messages) -> None:
    with pytest.raises(RequestError) as err:
        parse_chat({"model": "m", "messages": messages}, "m")
    assert err.value.param == "messages"


def test_chat_names_its_length_field() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": None}]}
    assert parse_chat(body, "m").messages == [{"role": "user", "content": ""}]
    with pytest.raises(RequestError) as err:
        parse_chat({**body, "max_completion_tokens": -1}, "m")
    assert err.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True, "top_logprobs": 3}, None),
        ({"logprobs": False}, None),
        ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": 2}, "logprobs"),  # chat's logprobs is a boolean
        ({"echo": True}, "echo"),
    ],
)
def test_chat_logprobs_fields(extra, param) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    if param is None:
        parse_chat(body, "m")
        return
    with pytest.raises(RequestError) as err:
        parse_chat(body, "m")
    assert err.value.param == param, err.value.message


def test_logprobs_within_the_bundle() -> None:
    """More logprobs than the bundle returns, or prompt logprobs from a bundle built without
    them, are 400s naming the field (the fake bundle's layout has max_logprobs 0)."""
    runner, _ = fake_runner()
    for body, param in [({"logprobs": 1}, "logprobs"), ({"logprobs": 0, "echo": True}, "echo")]:
        parsed = parse_completion({**OK, **body}, "m")
        with pytest.raises(RequestError) as err:
            check_fits(runner.config, [1, 2], parsed.params)
        assert err.value.param == param


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b"null"])
def test_bodies_that_are_not_objects(raw) -> None:
    with pytest.raises(RequestError):
        parse_body(raw)


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    runner, _ = fake_runner()
    params = parse_completion({**OK, "prompt": [1, 2]}, "m").params
    check_fits(runner.config, [1, 2, runner.config.vocab_size - 1], params)
    for bad in (-1, runner.config.vocab_size, 99999):
        with pytest.raises(RequestError) as err:
            check_fits(runner.config, [1, bad], params)
        assert err.value.param == "prompt" and f"token id {bad}" in err.value.message
    assert "outside the vocabulary" in str(json.dumps(err.value.message))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}]}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER]}, None),
        ({"tools": [WEATHER], "tool_choice": "required"}, None),
        ({"tools": [WEATHER], "tool_choice": "none"}, None),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            None,
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "other"}},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ],
)
def test_chat_tool_fields(extra, param) -> None:
    body = {**CHAT, **extra}
    if param is None:
        parsed = parse_chat(body, "m")
        assert parsed.tools == tuple(extra.get("tools", ()))
        return
    with pytest.raises(RequestError) as err:
        parse_chat(body, "m")
    assert err.value.param == param


def test_tool_choices_become_constraints_and_calls() -> None:
    """required: a JSON array of {name, parameters} (vLLM's schema), named: the parameters;
    calls parsed back in OpenAI's shape, and hermes / llama3_json text parsed for auto."""
    import json

    import jsonschema

    from neffkit.runtime.serve.tools import ToolStream, finish_reason, parse_calls

    required = parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "required"}, "m")
    spec = required.params.structured
    assert spec is not None and spec.kind == "json" and spec.field == "tool_choice"
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    jsonschema.validate(json.loads(text), json.loads(spec.source))
    req = required.tool_request
    content, calls = parse_calls(req, None, text)
    assert content is None and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert finish_reason(req, calls, "stop") == "tool_calls"
    named = parse_chat(
        {
            **CHAT,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        "m",
    )
    assert json.loads(named.params.structured.source) == WEATHER["function"]["parameters"]
    _, calls = parse_calls(named.tool_request, None, '{"city": "Oslo"}')
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert finish_reason(named.tool_request, calls, "stop") == "stop"

    auto = parse_chat({**CHAT, "tools": [WEATHER]}, "m").tool_request
    call = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    hermes = f"Let me check.\n<tool_call>\n{call}\n</tool_call>"
    content, calls = parse_calls(auto, "hermes", hermes)
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Rome"
    }
    assert parse_calls(auto, "hermes", "no calls here") == ("no calls here", [])
    llama = '{"name": "get_weather", "parameters": {"city": "Lima"}}'
    assert parse_calls(auto, "llama3_json", llama)[1][0]["function"]["name"] == "get_weather"
    # streamed: content up to the tag (a partial tag held back), then the call's two deltas
    stream, deltas = ToolStream(auto, "hermes"), []
    for i in range(0, len(hermes), 3):
        deltas += stream.feed(hermes[i : i + 3])
    more, reason = stream.finish("stop")
    deltas += more
    text = "".join(d.get("content", "") for d in deltas)
    assert text.strip() == "Let me check." and "<" not in text
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert heads[0]["function"]["name"] == "get_weather" and reason == "tool_calls"
    assert json.loads(heads[1]["function"]["arguments"]) == {"city": "Rome"}


def test_tool_messages_reach_the_template() -> None:
    """An assistant's tool calls (arguments as objects) and the tool's result with its id."""
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }
    messages = parse_chat(body, "m").messages
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [[True, 0.0, None], 1e308]},
        {"tools": [-1.0, {"model": 31}], "guided_choice": True},
        {"tools": [8], "parallel_tool_calls": ["x"]},
        {"tools": [WEATHER], "parallel_tool_calls": "yes"},
        {"guided_grammar": 1e-320},
        {"structured_outputs": {"choice": []}},
        {"tool_choice": {"type": "function"}, "tools": [WEATHER]},
    ],
)
def test_malformed_tools_and_constraints_are_400s(extra) -> None:
    """What the fuzzer found: every malformed shape is a RequestError, never a crash."""
    with pytest.raises(RequestError):
        parse_chat({**CHAT, **extra}, "m")
