"""Bounds on JSON constraints, so a small model cannot wander inside a valid schema forever.

A JSON grammar is valid for outputs no client wants: keys a pydantic model never declared (its
schema says nothing of other keys, so JSON Schema allows them), whitespace without end, and
numbers whose digits go on until max_tokens (LangChain's `with_structured_output` on SmolLM2:
`"age": 300000000…` until a length error). Three bounds, as vLLM's default backend (xgrammar)
and OpenAI's strict schemas have them:

- `closed`: an object schema that declares its keys and says nothing of others takes none
  (`additionalProperties: false`); a client that wants them says `additionalProperties: true`;
- `WHITESPACE`: at most 24 whitespace characters where JSON allows them (a newline and the
  indentation of pretty-printed JSON 11 levels deep);
- `DigitRun`: at most MAX_DIGITS digits in a row outside strings (int64 has 19, a float's
  shortest repr 17 significant); past them the digit-only tokens are masked, so the number
  ends. Inside strings digits are the schema's business (a string's maxLength or pattern).

Imports no torch and no llguidance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WHITESPACE = r"[\x20\x0A\x0D\x09]{1,24}"
MAX_DIGITS = 24

# keywords whose values are subschemas, lists of them, or maps of them
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_COMPOSED = ("anyOf", "oneOf", "allOf", "$ref")  # keys may come from there


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with every object schema that declares its keys (`properties`) and says nothing
    of others closed to them. Left open: a free-form object (`{"type": "object"}`, JSON mode),
    one whose keys may come from a composition beside them, and a branch of allOf (closing
    each would leave their intersection nothing)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    declared = "properties" in out and not any(k in out for k in _OTHER_KEYS + _COMPOSED)
    if declared and not in_all_of:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s, key == "allOf") for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    return out


def digit_only(text: bytes) -> bool:
    """Is a token's text one or more ASCII digits (what continues a number and nothing else)?"""
    return bool(text) and text.isdigit() and text.isascii()


class DigitRun:
    """The digits in a row at the end of a JSON output, outside strings: a tiny scan of each
    token's text (strings and their escapes), enough to know where a number runs on."""

    __slots__ = ("digits", "in_string", "escaped")

    def __init__(self) -> None:
        self.digits = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: bytes) -> None:
        for byte in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == 0x5C:  # backslash
                    self.escaped = True
                elif byte == 0x22:  # the closing quote
                    self.in_string = False
                continue
            if 0x30 <= byte <= 0x39:
                self.digits += 1
                continue
            self.digits = 0
            self.in_string = byte == 0x22

    @property
    def capped(self) -> bool:
        return self.digits >= MAX_DIGITS


class BoundedMatcher:
    """A JSON constraint's llguidance matcher with its DigitRun: what a request holds as its
    grammar (the engine's mask filler reads both)."""

    __slots__ = ("inner", "run", "token_text")

    def __init__(self, inner: Any, token_text: Callable[[int], bytes]) -> None:
        self.inner, self.token_text = inner, token_text
        self.run = DigitRun()

    def consume_token(self, token: int) -> bool:
        if not self.inner.consume_token(token):
            return False
        self.run.feed(self.token_text(token))
        return True

    def is_stopped(self) -> bool:
        return bool(self.inner.is_stopped())
