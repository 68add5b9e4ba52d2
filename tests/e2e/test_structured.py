"""Structured outputs, tool calls, penalties, logit_bias and min_tokens through a real server and
the real `openai` client, on the test llama (random weights: a constraint is what makes its
output valid). Greedy penalties, biases and min_tokens equal HF's own logits processors
(`repetition_penalty`, `sequence_bias`, `min_new_tokens`), which follow the same rules."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.support.server import TOOLS_TEMPLATE, Server, build_serve_bundle

pytestmark = pytest.mark.xdist_group("server")

COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model's JSON ends
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "ok", "n", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def served(session_dir: Path, hf_model_dir) -> Iterator[Server]:
    bundle = build_serve_bundle(session_dir, hf_model_dir)
    srv = Server(bundle, "--served-model-name", "tiny", "--chat-template", TOOLS_TEMPLATE)
    yield srv
    srv.stop()


def _streamed_text(stream) -> str:
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constraints_are_followed_streamed_or_not(served: Server, temperature: float) -> None:
    """A JSON schema (response_format), a regex and a choice (vLLM's fields) hold for every
    output, greedy and sampled, whole and streamed (the same text for the same seed)."""
    client = served.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    cases = [
        ({"response_format": fmt}, COMPACT, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (
            {},
            {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) or pytest.fail(t),
        ),
        (
            {},
            {"guided_choice": ["yes", "no", "maybe"]},
            lambda t: t in ("yes", "no", "maybe") or pytest.fail(t),
        ),
    ]
    for seed in range(3):
        for kw, extra, check in cases:
            args = dict(
                model="tiny",
                messages=[{"role": "user", "content": f"go {seed}"}],
                max_tokens=40,
                temperature=temperature,
                seed=seed,
                extra_body={**extra, "stop_token_ids": []},
                **kw,
            )
            whole = client.chat.completions.create(**args)
            text = whole.choices[0].message.content
            check(text)
            assert _streamed_text(client.chat.completions.create(**args, stream=True)) == text
    done = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": "(ab)+c"},
    )
    assert re.fullmatch("(ab)+c", done.choices[0].text)


def test_tool_calls_required_named_and_auto(served: Server) -> None:
    """required: a parseable call of the openai client's types, finish_reason tool_calls;
    a named function: its arguments; both streamed as vLLM streams them (name, then arguments)."""
    client = served.client()
    messages = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, finish in (("required", "tool_calls"), (named, "stop")):
        args = dict(
            model="tiny",
            messages=messages,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=44,
            temperature=0,
            extra_body=COMPACT,
            parallel_tool_calls=False,
        )
        out = client.chat.completions.create(**args)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == finish and len(calls) >= 1
        assert calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments)["unit"] in ("c", "f")
        streamed: dict[int, dict[str, str]] = {}
        reason = None
        for chunk in client.chat.completions.create(**args, stream=True):
            if not chunk.choices:
                continue
            for tc in chunk.choices[0].delta.tool_calls or []:
                got = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                got["name"] += (tc.function.name or "") if tc.function else ""
                got["arguments"] += (tc.function.arguments or "") if tc.function else ""
            reason = chunk.choices[0].finish_reason or reason
        assert reason == finish
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]
    # the round trip: the call and its result go back through the chat template
    follow = messages + [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0].function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=follow, max_tokens=8, tools=[WEATHER], tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None


def test_bad_constraints_get_400_naming_the_field(served: Server) -> None:
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "wat"}}},
                    },
                }
            },
            "response_format",
        ),
        ({"guided_grammar": "start: (("}, "guided_grammar"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ]
    for extra, param in cases:
        resp = httpx.post(f"{served.url}/v1/chat/completions", json={**base, **extra})
        assert resp.status_code == 400, (extra, resp.text)
        assert resp.json()["error"]["param"] == param, resp.text
    greedy = {**base, "temperature": 0}
    assert httpx.post(f"{served.url}/v1/chat/completions", json=greedy).status_code == 200


def _hf(model_dir: Path, prompt: list[int], new: int, **kw) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kw
    )
    return out[0, len(prompt) :].tolist()


def test_penalties_biases_and_min_tokens_equal_hf(served: Server, hf_model_dir) -> None:
    """Greedy tokens with repetition_penalty, logit_bias and min_tokens equal HF's generate with
    repetition_penalty, sequence_bias and min_new_tokens; presence and frequency penalties
    (which HF lacks) repeat fewer tokens than plain greedy decoding."""
    model = hf_model_dir("llama")
    prompt = [5, 9, 14, 9, 5, 30, 31, 5]
    new = 16

    def ours(**extra) -> list[int]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": new,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }
        resp = httpx.post(f"{served.url}/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    plain = ours(ignore_eos=True)
    assert plain == _hf(model, prompt, new)
    assert ours(ignore_eos=True, repetition_penalty=1.6) == _hf(
        model, prompt, new, repetition_penalty=1.6
    )
    bias = {str(plain[1]): -7.5, str(plain[3] + 1): 4.0}
    want = _hf(model, prompt, new, sequence_bias={(int(k),): v for k, v in bias.items()})
    assert ours(ignore_eos=True, logit_bias=bias) == want != plain
    stop = plain[2]  # a stop token that would end the output at 3 tokens
    assert ours(stop_token_ids=[stop])[-1] == stop and len(ours(stop_token_ids=[stop])) == 3
    held = ours(stop_token_ids=[stop], min_tokens=6)
    assert held == _hf(model, prompt, new, eos_token_id=stop, min_new_tokens=6)[: len(held)]
    assert len(held) > 6 and stop not in held[:6]
    repeats = len(plain) - len(set(plain))
    for field in ("presence_penalty", "frequency_penalty"):
        out = ours(ignore_eos=True, **{field: 2.0})
        assert out != plain and len(out) - len(set(out)) <= repeats
