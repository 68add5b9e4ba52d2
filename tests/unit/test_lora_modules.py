"""`neffkit run --lora-modules`: vLLM's forms (several values after one flag, repeated flags,
`--flag=value`, JSON entries) read into adapters by name, and what is refused."""

from __future__ import annotations

import pytest

from neffkit.cli.run import LORA_MODULES, _spread
from neffkit.errors import NeffkitError
from neffkit.runtime.serve.lora import LoraModule, check_name, parse_lora_module

JSON = '{"name": "c", "path": "/z", "base_model_name": "m"}'


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (
            ["B", "--lora-modules", "a=/x", "b=/y"],
            ["B", "--lora-modules", "a=/x", "--lora-modules", "b=/y"],
        ),
        (
            ["--lora-modules", "a=/x", "b=/y", "B"],
            ["--lora-modules", "a=/x", "--lora-modules", "b=/y", "B"],
        ),
        (
            ["B", "--lora-modules=a=/x", "b=/y"],
            ["B", "--lora-modules=a=/x", "--lora-modules", "b=/y"],
        ),
        (
            ["B", "--lora-modules", JSON, "b=/y", "--port", "1"],
            ["B", "--lora-modules", JSON, "--lora-modules", "b=/y", "--port", "1"],
        ),
        (
            ["B", "--lora-modules", "a=/x", "--", "b=/y"],
            ["B", "--lora-modules", "a=/x", "--", "b=/y"],
        ),
        (["B", "--prompt", "a=b", "c=d"], ["B", "--prompt", "a=b", "c=d"]),
    ],
)
def test_values_after_one_flag_are_spread(args: list[str], want: list[str]) -> None:
    assert _spread(args, LORA_MODULES) == want


def test_entries_read_as_vllm_reads_them() -> None:
    assert parse_lora_module("sql=/a/b=c") == LoraModule("sql", "/a/b=c")
    assert parse_lora_module(JSON) == LoraModule("c", "/z", "m")
    assert parse_lora_module('{"name": "org/x-1.2", "path": "p"}') == LoraModule("org/x-1.2", "p")


@pytest.mark.parametrize(
    "text",
    [
        "sql",
        "sql=",
        "=/x",
        "a b=/x",
        "-a=/x",
        "x" * 129 + "=/x",
        "{",
        '{"name": "a"}',
        '{"name": "a", "path": 5}',
        '{"name": "a", "path": "p", "extra": 1}',
        '["a"]',
    ],
)
def test_bad_entries_are_refused(text: str) -> None:
    with pytest.raises(NeffkitError):
        parse_lora_module(text)


def test_names() -> None:
    assert check_name("a" * 128, "lora_name") == "a" * 128
    for bad in ["", "a,b", "a\nb", ".a", "a" * 129, 5, None, "é"]:
        with pytest.raises(NeffkitError):
            check_name(bad, "lora_name")
