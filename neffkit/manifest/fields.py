"""Field readers: each checks one YAML value and names its path in the error, e.g.
`buckets.decode[1]: expected a positive int, got -4`."""

from __future__ import annotations

from typing import Any

from neffkit.errors import ManifestError


def describe(value: Any) -> str:
    return repr(value) if not isinstance(value, dict | list) else type(value).__name__


def mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{path}: expected a mapping, got {describe(value)}")
    return value


def no_unknown(data: dict[str, Any], allowed: tuple[str, ...], path: str) -> None:
    for key in data:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            raise ManifestError(
                f"{where}: unknown key; allowed here: {', '.join(allowed)}",
                hint="check the spelling against docs/manifest.md",
            )


def positive_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ManifestError(f"{path}: expected a positive int, got {describe(value)}")
    return value


def non_negative_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"{path}: expected an int >= 0, got {describe(value)}")
    return value


def choice(value: Any, choices: tuple[str, ...], path: str) -> str:
    if value not in choices:
        raise ManifestError(f"{path}: unknown value {value!r}; available: {', '.join(choices)}")
    return value


def bucket_list(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ManifestError(
            f"{path}: expected a non-empty list of positive ints, got {describe(value)}"
        )
    items = tuple(positive_int(v, f"{path}[{i}]") for i, v in enumerate(value))
    for i in range(1, len(items)):
        if items[i] <= items[i - 1]:
            raise ManifestError(
                f"{path}[{i}]: buckets must be sorted and unique, got {list(items)}",
                hint=f"write them ascending: {sorted(set(items))}",
            )
    return items


def string_list(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ManifestError(f"{path}: expected a list of strings, got {describe(value)}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise ManifestError(f"{path}[{i}]: expected a string, got {describe(v)}")
    return tuple(value)
