"""Import rules between the package's rooms (DESIGN.md "Layout"), read from the source with ast.

Data flows one way: manifest → plan → trace → check → compile → bundle → runtime. The runtime
needs no compiler and no model code; bundle.py is the contract both sides depend on; the manifest
knows target names and audit rule ids from the leaf module `targets`, not from `compile/`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "neffkit"


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, lazily inside functions included (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def files(pattern: str) -> list[Path]:
    found = sorted(PACKAGE.glob(pattern))
    assert found, pattern
    return found


RULES = [
    # (files, forbidden module prefixes)
    ("runtime/*.py", ("neffkit.compile", "neffkit.models", "torch._dynamo", "torch._inductor")),
    ("bundle.py", ("neffkit.compile", "neffkit.runtime", "neffkit.models", "torch")),
    ("manifest.py", ("neffkit.compile", "neffkit.runtime")),
    ("targets.py", ("neffkit",)),
    ("errors.py", ("neffkit",)),
    ("tensor_files.py", ("neffkit",)),
    ("models/*.py", ("neffkit.compile", "neffkit.runtime", "neffkit.manifest")),
    ("kernels/*.py", ("neffkit.compile", "neffkit.runtime", "neffkit.models")),
    ("compile/plan.py", ("torch",)),
    ("neff.py", ("torch", "neffkit.compile", "neffkit.runtime")),
    # builds and the runtime both load the kernel library: a leaf (torch and host facts only)
    ("cpu_kernels.py", ("neffkit.compile", "neffkit.runtime", "neffkit.models")),
]


@pytest.mark.parametrize(("pattern", "forbidden"), RULES, ids=[r[0] for r in RULES])
def test_import_rules(pattern: str, forbidden: tuple[str, ...]) -> None:
    bad = {
        f"{path.relative_to(REPO)}: {name}"
        for path in files(pattern)
        for name in imports_of(path)
        if any(name == p or name.startswith(p + ".") for p in forbidden)
    }
    assert not bad, sorted(bad)


def test_registries_hold_exactly_the_shared_names() -> None:
    from neffkit.compile.audit import RULES as AUDIT_RULES
    from neffkit.compile.backends import BACKENDS
    from neffkit.targets import AUDIT_RULE_IDS, TARGETS

    assert tuple(BACKENDS) == TARGETS
    assert tuple(AUDIT_RULES) == AUDIT_RULE_IDS


def test_layout_error_names_the_manifest_field(tmp_path: Path) -> None:
    from neffkit.errors import ManifestError
    from neffkit.manifest import parse_manifest
    from tests.conftest import DEMO_MODEL

    data = {
        "neffkit": 1,
        "model": str(DEMO_MODEL),
        "parallel": {"tp": 3},
        "buckets": {"prefill": [16], "decode": [1], "context": [64]},
    }
    with pytest.raises(ManifestError) as err:
        parse_manifest(data, tmp_path)
    assert err.value.message.startswith("parallel.tp: 3 does not divide")
