"""Request parsing and validation (runtime/protocol.py): every bad field is a RequestError naming
it, never an exception of another kind (which the server would turn into a 500)."""

from __future__ import annotations

import json

import pytest

from neffkit.errors import RequestError
from neffkit.runtime.limits import check_fits
from neffkit.runtime.protocol import parse_body, parse_chat, parse_completion
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
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"presence_penalty": 0}, None),
        ({"logit_bias": {"5": 100}}, "logit_bias"),
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
