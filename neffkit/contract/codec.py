"""bundle.json's codec: frozen dataclass records that (de)serialise themselves field by field.

Imports nothing from neffkit and no torch: every record of the on-disk contract builds on it.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from types import UnionType
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]
OptionValue = bool | int | float | str


def encode(value: object) -> JsonValue:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value  # type: ignore[return-value]


def _decode(hint: object, value: JsonValue) -> object:
    """A JSON value as the field's declared type: records, tuples of them, unions with None."""
    if value is None:
        return None
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, Record) and isinstance(value, dict):
                return arg.from_json(value)
            if get_origin(arg) is tuple and isinstance(value, list):
                return _decode(arg, value)
        return value
    if origin is tuple and isinstance(value, list):
        return tuple(_decode(args[0], v) for v in value)
    if isinstance(hint, type) and issubclass(hint, Record) and isinstance(value, dict):
        return hint.from_json(value)
    return dict(value) if isinstance(value, dict) else value


R = TypeVar("R", bound="Record")


class Record:
    """A frozen dataclass of bundle.json that (de)serialises itself field by field, using its
    type hints to rebuild nested records and tuples. `OMIT_NONE` drops unset fields."""

    OMIT_NONE: ClassVar[bool] = False

    def to_json(self) -> JsonObject:
        data = {f.name: encode(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]
        return {k: v for k, v in data.items() if v is not None} if self.OMIT_NONE else data

    @classmethod
    def from_json(cls: type[R], data: JsonObject) -> R:
        # mypy does not see a class object as Hashable (it checks the instances' unbound __hash__)
        hints, known = _field_hints(cls)  # type: ignore[arg-type]
        return cls(**{k: _decode(hints[k], v) for k, v in data.items() if k in known})


@functools.cache
def _field_hints(cls: type[Record]) -> tuple[dict[str, Any], frozenset[str]]:
    """A record class's resolved field types and names, once per class: resolving the string
    annotations is ~0.4 ms a call, and a bundle.json decodes ~300 records (0.11 s of startup)."""
    return get_type_hints(cls), frozenset(f.name for f in fields(cls))  # type: ignore[arg-type]
