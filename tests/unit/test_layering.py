"""Import rules between the package's rooms (docs/design.md "Layout"), read from the source with
ast: data flows one way, manifest → plan → trace → check → compile → bundle → runtime.

The runtime needs no compiler and no model code; the on-disk contract (contract/) is what both
sides depend on and imports neither; the manifest knows target names and audit rule ids from the
leaf module `targets`, not from `compile/`; the build reaches model families only through the
registry. No module imports itself back through others (no cycle anywhere), and no module or
function grows past the size where it should be split.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "neffkit"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports: lazily inside functions and under TYPE_CHECKING included,
    relative imports resolved (absolute names, and `module.name` for each imported name)."""
    names: set[str] = set()
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def files(pattern: str) -> list[Path]:
    found = sorted(PACKAGE.glob(pattern))
    assert found, pattern
    return found


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


FAMILY_MODULES = ("neffkit.models.decoder", "neffkit.models.shards") + tuple(
    f"neffkit.models.{p.name}" for p in (PACKAGE / "models").iterdir() if (p / "model.py").exists()
)
HTTP = ("fastapi", "starlette", "uvicorn", "httpx")
RUNTIME_ROOMS = tuple(f"neffkit.runtime.{r}" for r in ("serve", "engine", "spec_decode", "worker"))
ROOMS = sorted(
    p.stem for p in PACKAGE.iterdir() if p.name != "__init__.py" and p.stem != "__main__"
)
CONTRACT_MAY = ("contract", "errors", "targets")
RULES = [
    # (files, forbidden module prefixes)
    ("runtime/**/*.py", ("neffkit.compile", "neffkit.models", "torch._dynamo", "torch._inductor")),
    # the runtime's rooms (runtime/__init__.py): serve → engine → spec_decode → worker → the
    # shared modules beside them; the engine and the worker never see HTTP
    *[
        (f"runtime/{room}/*.py", ("neffkit.runtime.serve", *HTTP))
        for room in ("engine", "spec_decode", "worker")
    ],
    ("runtime/spec_decode/*.py", ("neffkit.runtime.engine",)),
    ("runtime/worker/*.py", ("neffkit.runtime.engine", "neffkit.runtime.spec_decode")),
    *[(f"runtime/{m}.py", RUNTIME_ROOMS) for m in ("config", "sampling_params", "tokenizer")],
    # the contract is a leaf: errors and target names only
    ("contract/*.py", tuple(f"neffkit.{room}" for room in ROOMS if room not in CONTRACT_MAY)),
    # the contract imports no torch (but the tensor files, which read and write tensors)
    *[(f"contract/{m}.py", ("torch",)) for m in ("abi", "bundle", "codec", "records", "pack")],
    ("manifest/*.py", ("neffkit.compile", "neffkit.runtime", "torch", *FAMILY_MODULES)),
    ("targets.py", ("neffkit",)),
    ("errors.py", ("neffkit",)),
    ("models/**/*.py", ("neffkit.compile", "neffkit.runtime", "neffkit.manifest")),
    ("models/**/config.py", ("torch",)),
    ("models/registry.py", ("torch",)),
    ("kernels/*.py", ("neffkit.compile", "neffkit.runtime", "neffkit.models")),
    ("compile/plan.py", ("torch",)),
    ("compile/units.py", ("torch",)),
    # the build finds model families only through the registry
    ("compile/**/*.py", FAMILY_MODULES),
    ("audit/*.py", ("neffkit.compile", "neffkit.runtime", "torch")),
    # builds and the runtime both load the kernel library: a leaf (torch and host facts only)
    ("platform/cpu_kernels.py", ("neffkit.compile", "neffkit.runtime", "neffkit.models")),
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


def test_no_folder_holds_more_than_15_modules() -> None:
    crowded = {
        str(d.relative_to(REPO)): n
        for d in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > 15
    }
    assert not crowded, crowded


def test_no_import_cycle() -> None:
    """No module reaches itself through the modules it imports (Tarjan's strongly connected
    components over every import, lazy and TYPE_CHECKING ones included)."""
    modules = {module_name(p): p for p in sources()}
    graph = {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_modules_and_functions_stay_small() -> None:
    """No module over 400 lines and no function over 60, unless a comment on its first line
    says why (`# long: ...`)."""
    too_long = []
    for path in sources():
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                why = "# long:" in lines[node.lineno - 1]
                if length > MAX_FUNCTION_LINES and not why:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length}")
    assert not too_long, too_long


def test_registries_hold_exactly_the_shared_names() -> None:
    from neffkit.audit.rules import RULES as AUDIT_RULES
    from neffkit.compile.backends import BACKENDS
    from neffkit.targets import AUDIT_RULE_IDS, TARGETS

    assert tuple(BACKENDS) == TARGETS
    assert tuple(AUDIT_RULES) == AUDIT_RULE_IDS


def test_every_architecture_resolves_to_its_family_parts() -> None:
    """Each registry entry names a config class, a graph module and sharding rules that exist."""
    import importlib

    from neffkit.models.registry import ARCHITECTURES

    for arch, family in ARCHITECTURES.items():
        config = importlib.import_module(f"neffkit.models.{family.package}.config")
        model = importlib.import_module(f"neffkit.models.{family.package}.model")
        assert hasattr(config, family.config), arch
        assert hasattr(model, family.graph) and hasattr(model, family.shards), arch


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


MAX_POSITIONAL = 3  # a large dataclass's first few identity fields may go by position
LARGE_DATACLASS = 6  # fields


def _is_dataclass(node: ast.ClassDef) -> bool:
    """@dataclass, @dataclass(...), @dataclasses.dataclass and @dataclasses.dataclass(...)."""
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
            isinstance(target, ast.Attribute) and target.attr == "dataclass"
        ):
            return True
    return False


def _own_fields(node: ast.ClassDef) -> int:
    """Annotated class-level names, ClassVars left out (`x: ClassVar[int]`, `"ClassVar[int]"`)."""
    return sum(
        1
        for s in node.body
        if isinstance(s, ast.AnnAssign)
        and isinstance(s.target, ast.Name)
        and not ast.unparse(s.annotation).strip("'\"").startswith(("ClassVar", "typing.ClassVar"))
    )


def large_dataclasses() -> dict[str, int]:
    """Every @dataclass class in neffkit/ with more than 6 fields, by name: its own annotated
    fields plus those of the dataclasses it derives from (bases resolved by name)."""
    classes: dict[str, ast.ClassDef] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and _is_dataclass(node):
                classes[node.name] = node

    def count(name: str) -> int:
        node = classes[name]
        bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
        return _own_fields(node) + sum(count(b) for b in bases if b in classes and b != name)

    sizes = {name: count(name) for name in classes}
    return {name: n for name, n in sizes.items() if n > LARGE_DATACLASS}


def test_large_dataclasses_are_built_by_keyword() -> None:
    """A dataclass with more than 6 fields is built by keyword: a call in neffkit/ to one (by
    name, `Name(...)` or `module.Name(...)`, or `cls(...)` in its own body) passes at most 3
    arguments by position, and no `*args` splat (its length is unknown here)."""
    large = large_dataclasses()
    assert {"GraphShape", "SamplingParams", "SequenceState"} <= set(large), sorted(large)
    bad = []
    for path in sources():
        tree = ast.parse(path.read_text())
        owner = {  # `cls(...)` inside a large dataclass's methods builds that class
            id(call): c.name
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c.name in large
            for call in ast.walk(c)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "cls"
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            name = owner.get(id(node), name)
            splat = any(isinstance(a, ast.Starred) for a in node.args)
            if name in large and (len(node.args) > MAX_POSITIONAL or splat):
                n = "*" if splat else len(node.args)
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {name}({n} positional)")
    assert not bad, bad
