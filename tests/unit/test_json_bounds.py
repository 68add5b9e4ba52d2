"""Bounds on JSON constraints (runtime/json_bounds.py): object schemas closed to undeclared keys
(pydantic's schemas never say), bounded whitespace, and a cap on digits in a row outside
strings, checked against llguidance's real matcher over a byte-level tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from neffkit.runtime import json_bounds
from neffkit.runtime.engine.structured import Grammars
from neffkit.runtime.sampling_params import StructuredSpec
from tests.unit.test_hostile_engine import _byte_tokenizer

PERSON = {
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
        "extra": {"type": "object", "additionalProperties": True},
    },
    "$defs": {"Pet": {"properties": {"kind": {"type": "string"}}}},
    "required": ["name"],
}


def test_object_schemas_are_closed_unless_they_say_otherwise() -> None:
    out = json_bounds.closed(PERSON)
    assert out["additionalProperties"] is False
    assert out["$defs"]["Pet"]["additionalProperties"] is False  # properties alone: an object
    assert out["properties"]["extra"]["additionalProperties"] is True  # said: kept
    assert "additionalProperties" not in PERSON  # the request's schema is not changed
    both = json_bounds.closed({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in both["allOf"])
    assert json_bounds.closed(True) is True
    assert json_bounds.closed({"type": "object"}) == {"type": "object"}  # JSON mode: free-form
    calls = {"type": "object", "anyOf": [{"properties": {"name": {}}, "required": ["name"]}]}
    assert "additionalProperties" not in json_bounds.closed(calls)  # keys from anyOf
    assert json_bounds.closed(calls)["anyOf"][0]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("text", "digits", "in_string"),
    [
        (b'{"a": 12', 2, False),
        (b'{"a": "1234567', 0, True),
        (b'{"a": "x\\"12', 0, True),  # an escaped quote does not end the string
        (b'{"a": "12", "b": 345', 3, False),
        (b'{"a": 1.25', 2, False),
    ],
)
def test_digit_run_counts_digits_outside_strings(text: bytes, digits: int, in_string: bool):
    run = json_bounds.DigitRun()
    for i in range(len(text)):  # byte by byte, as tokens of one byte each
        run.feed(text[i : i + 1])
    assert (run.digits, run.in_string) == (digits, in_string)


def _grammars() -> Grammars:
    grammars = Grammars.of(_byte_tokenizer(), 257, (256,))
    assert grammars is not None
    return grammars


def _walk(grammars: Grammars, spec: StructuredSpec, text: str):
    """The request's matcher after `text`, token by token, and its next mask."""
    matcher = grammars.matcher(spec)
    for token in grammars.vocab.tokenizer.tokenize_str(text):
        assert matcher.consume_token(token), text
    mask = np.zeros((1, grammars.vocab.words), np.int32)
    grammars.fill(mask, [(matcher, 0)])
    allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
    decode = grammars.vocab.tokenizer.decode_bytes
    return matcher, {decode([int(t)]) for t in allowed}


def test_an_undeclared_key_is_refused_and_a_number_ends_after_max_digits() -> None:
    grammars = _grammars()
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    spec = StructuredSpec("json", json.dumps(schema), "response_format")
    _, allowed = _walk(grammars, spec, '{"')
    assert not any(t[:1].isalpha() and not b"age".startswith(t) for t in allowed if t)
    short = '{"age": ' + "9" * (json_bounds.MAX_DIGITS - 1)
    _, allowed = _walk(grammars, spec, short)
    assert any(json_bounds.digit_only(t) for t in allowed)
    _, allowed = _walk(grammars, spec, short + "9")
    assert allowed and not any(json_bounds.digit_only(t) for t in allowed)
    assert b"}" in allowed
    text = {"type": "object", "properties": {"id": {"type": "string"}}}
    spec = StructuredSpec("json", json.dumps(text), "response_format")
    _, allowed = _walk(grammars, spec, '{"id": "' + "7" * 40)  # digits in a string: free
    assert any(json_bounds.digit_only(t) for t in allowed)


def test_whitespace_is_bounded() -> None:
    grammars = _grammars()
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    spec = StructuredSpec("json", schema, "response_format", True)
    _, allowed = _walk(grammars, spec, "{" + " " * 23)
    assert b" " in allowed
    _, allowed = _walk(grammars, spec, "{" + " " * 24)
    assert b" " not in allowed and b'"' in allowed
