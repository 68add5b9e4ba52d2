"""Fixtures only tests/e2e uses: the run's shared session directory, bundles built once per
run (through the test cache, tests/support/bundles.py), the prebuild that starts every worker
building them side by side under `make test`, and the HF oracle's greedy generate."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.adapters import (
    ORACLE_NAMES,
    PROMPTS,
    build_lora_bundle,
    make_adapters,
    peft_greedy,
)
from tests.support.bundles import (
    BUNDLES_IN_TEST,
    EP,
    LOWERED,
    LOWERED_IN_TEST,
    PREBUILD,
    TP2_IN_TEST,
    build_session_bundle,
    claimed,
    lowered_build,
)
from tests.support.cache import cached_dir
from tests.support.models import EXTRA, MAX_NEW, MODELS, PARALLEL, hf_greedy_ids
from tests.support.server import TOOLS_TEMPLATE, Server, build_serve_bundle


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the run; xdist workers share it (their basetemps are its siblings)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "neffkit-shared"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def bundle(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Callable[[str], Path]:
    """kind → a bundle built from that kind's tiny checkpoint (built once per session)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            result = build_session_bundle(
                session_dir,
                hf_model_dir(kind),
                kind,
                buckets=MODELS[kind][2],
                **EXTRA.get(kind, {}),
            )
            built[kind] = result.bundle
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tp_bundle(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Callable[[str], Any]:
    """kind → the BuildResult of that kind's tp > 1 bundle (built once per session)."""
    built: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in built:
            parallel, buckets = PARALLEL[kind]
            built[kind] = build_session_bundle(
                session_dir,
                hf_model_dir(kind),
                f"{kind}_tp{parallel['tp']}",
                buckets=buckets,
                parallel=parallel,
            )
        return built[kind]

    return get


@pytest.fixture(scope="session", autouse=True)
def prebuilt(session_dir: Path, hf_model_dir, bundle, tp_bundle, lowered) -> None:
    """With NEFFKIT_TEST_PREBUILD=1 (`make test`), every worker starts by building the bundles
    most tests share, each taking the next one no other worker has claimed: builds run side by
    side from the start instead of one worker waiting on the build another started. The test
    modules' own bundles (the largest) go first."""
    if os.environ.get("NEFFKIT_TEST_PREBUILD") != "1":
        return
    own = {
        name: (lambda fn=fn: fn(session_dir, hf_model_dir)) for name, (fn, _) in PREBUILD.items()
    }
    jobs: list[tuple[str, Callable[[], object]]] = [
        (name, own[name]) for name, (_, stage) in PREBUILD.items() if stage == 0
    ]
    jobs += [(kind, lambda k=kind: bundle(k)) for kind in BUNDLES_IN_TEST]
    jobs += [(f"{k}_tp2", lambda k=k: tp_bundle(k)) for k in TP2_IN_TEST]
    jobs += [(f"{k}_neuron_tp{tp}", lambda k=k, tp=tp: lowered(k, tp)) for k, tp in LOWERED_IN_TEST]
    for later in (1, 2):
        jobs += [(name, own[name]) for name, (_, stage) in PREBUILD.items() if stage == later]
    for name, build in jobs:
        with claimed(session_dir, name) as mine:
            if mine:
                build()


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[int], int], list[int]]:
    """The oracle: HF transformers greedy generate on the saved checkpoint."""
    import transformers

    models: dict[Path, Any] = {}

    def run(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        if model_dir not in models:
            models[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        return hf_greedy_ids(models[model_dir], prompt, max_new_tokens)

    return run


@pytest.fixture(scope="session")
def lowered(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Callable[..., Path]:
    """(kind, tp) → a lowered neuron bundle, built once per session with --verify."""
    built: dict[tuple[str, int], Path] = {}

    def get(kind: str, tp: int = 1) -> Path:
        if (kind, tp) not in built:
            name = f"{kind}_neuron_tp{tp}"
            parallel = {"tp": tp, "ep": EP.get(kind, 1) if tp > 1 else 1}
            built[(kind, tp)] = lowered_build(
                session_dir,
                hf_model_dir(kind),
                name,
                "--lower-only",
                "--verify",
                buckets=LOWERED[(kind, tp)],
                parallel=parallel,
            )
        return built[(kind, tp)]

    return get


@pytest.fixture(scope="module")
def serve_bundle(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Path:
    """The tiny server bundle (tests/support/server.py), built once through the test cache."""
    return build_serve_bundle(session_dir, hf_model_dir)


@pytest.fixture(scope="module")
def server(serve_bundle: Path) -> Iterator[Server]:
    """A live server on it for the module (a module that needs flags defines its own), with
    a chat template that takes tools (a request's tools stay out of the tiny context)."""
    srv = Server(serve_bundle, "--served-model-name", "tiny", "--chat-template", TOOLS_TEMPLATE)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def lora_bundle(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Path:
    """The multi-LoRA tests' bundle (tests/support/adapters.py)."""
    return build_lora_bundle(session_dir, hf_model_dir)


@pytest.fixture(scope="session")
def adapters(hf_model_dir: Callable[[str], Path]) -> dict[str, Path]:
    """PEFT adapters of the tiny Llama by name (tests/support/adapters.py)."""
    return make_adapters(hf_model_dir("llama"))


@pytest.fixture(scope="session")
def oracle(
    hf_model_dir: Callable[[str], Path], adapters: dict[str, Path]
) -> dict[str | None, list[list[int]]]:
    """name (None: the base) → HF + peft's greedy tokens of each of PROMPTS."""
    base = hf_model_dir("llama")
    return {
        n: peft_greedy(base, adapters[n] if n else None, PROMPTS, MAX_NEW) for n in ORACLE_NAMES
    }


@pytest.fixture(scope="session")
def tiny_gguf() -> tuple[Path, Path]:
    """(the GGUF file, its float32 conversion), made once per machine (keyed by the writer's
    source and the gguf / transformers versions)."""
    from neffkit.checkpoints import gguf as converter
    from tests.support import gguf_files

    recipe = [
        inspect.getsource(gguf_files),
        Path(converter.__file__).read_text(),
        importlib.metadata.version("gguf"),
        importlib.metadata.version("transformers"),
    ]
    digest = hashlib.sha256("\0".join(recipe).encode()).hexdigest()[:16]

    def make(out: Path) -> None:
        gguf_files.write_tiny_llama(out / "tiny.gguf")
        converter.convert_gguf(out / "tiny.gguf", out / "float32")

    root = cached_dir(f"models/gguf_tiny-{digest}", make)
    return root / "tiny.gguf", root / "float32"
