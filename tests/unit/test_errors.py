"""Every user-facing error has its hint: each NeffkitError class raised anywhere in neffkit/ gives
a `hint:` line even where the raise site knows no specific fix, and the docs pages its hint names
exist; the CLI prints it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from neffkit.errors import NeffkitError
from tests.support import REPO
from tests.support.cli import run_cli
from tests.unit.test_docs import NAMED, check

PACKAGE = REPO / "neffkit"


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _raised_names() -> dict[str, set[str]]:
    """Every class name a `raise Name(...)` in neffkit/ constructs → the modules raising it."""
    raised: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name:
                    raised.setdefault(name, set()).add(_module(path))
    return raised


def _user_error_classes() -> dict[str, type[NeffkitError]]:
    """The NeffkitError subclasses neffkit/ raises, found by name in the raising modules."""
    found: dict[str, type[NeffkitError]] = {}
    for name, modules in _raised_names().items():
        for module in sorted(modules):
            cls = getattr(importlib.import_module(module), name, None)
            if isinstance(cls, type) and issubclass(cls, NeffkitError):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


CLASSES = _user_error_classes()


def test_the_walk_finds_the_error_classes() -> None:
    names = {cls.__name__ for cls in CLASSES.values()}
    assert {
        "ManifestError",
        "ModelError",
        "BundleError",
        "RequestError",
        "BuildError",
        "NeffkitError",
        "ServerBusy",
        "EngineDead",
        "RankFailure",
    } <= names


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_user_error_class_has_a_hint_naming_docs_that_exist(name: str) -> None:
    cls = CLASSES[name]
    error = cls("something went wrong")  # a raise site that knows no specific fix
    assert error.hint and error.hint.strip(), name
    pages = list(NAMED.finditer(error.hint))
    assert pages, f"{name}: the hint names no docs page: {error.hint}"
    bad = [
        problem
        for m in pages
        for problem in check(REPO / m.group(1), m.group(2)[1:] if m.group(2) else None, name)
    ]
    assert not bad, bad
    assert cls("x", hint="do this").hint == "do this"  # the raise site's own hint wins


def test_the_cli_prints_a_hint_for_an_error_raised_without_one(tmp_path: Path) -> None:
    """`buckets.decode[1]: expected a positive int` is raised with no hint of its own."""
    path = tmp_path / "m.yaml"
    path.write_text(
        f"neffkit: 1\nmodel: {REPO / 'models' / 'demo-llama'}\n"
        "buckets: {prefill: [16], decode: [1, -4], context: [64]}\n"
    )
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "error: buckets.decode[1]: expected a positive int, got -4",
        "hint: every field and its values: docs/manifest.md; common manifest errors: "
        "docs/troubleshooting.md#manifests",
    ]
