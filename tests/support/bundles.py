"""Bundles built through the test cache: once per machine, shared by the xdist workers
(`make test` runs two), each published by rename. Each family's bundle has as few graphs as its
tests need (one decode bucket unless a test needs a bucket switch). Which bundles `make test`
builds (the rest in `make test-all`), and the prebuild's registry of test modules' own bundles
(the prebuild itself is tests/e2e/conftest.py's `prebuilt`)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.cache import artifact_cache, cached_dir, environment_digest
from tests.support.cli import run_cli
from tests.support.models import write_manifest


def bundle_key(manifest_path: Path, *flags: str) -> str:
    """What a test bundle is made from, in the product's own keys: the early (trace) key of
    every graph on every rank (the resolved manifest, the checkpoint's stamps, neffkit's source,
    torch and lowering versions, the graph) and the build flags. Equal keys, equal bundles
    (builds are deterministic), so a bundle is built once per machine until one of them moves."""
    from neffkit.compile.backends import get_backend
    from neffkit.compile.cache.keys import trace_key
    from neffkit.compile.plan import make_plan
    from neffkit.manifest import load_manifest

    manifest = load_manifest(manifest_path)
    backend = get_backend(manifest.target)
    keys = [
        trace_key(manifest, backend, spec, rank).digest
        for spec in make_plan(manifest).graphs
        for rank in range(manifest.parallel.tp)
    ]
    env = environment_digest()
    return hashlib.sha256(json.dumps([keys, sorted(flags), env]).encode()).hexdigest()[:16]


def cached_bundle(
    session_dir: Path,
    name: str,
    manifest_path: Path,
    flags: tuple[str, ...],
    build: Callable[[Path], dict[str, Any]],
) -> tuple[Path, dict[str, Any]]:
    """The bundle NAME of this manifest and flags from the test cache, else built there by
    `build(out)` (which returns the build report), once per machine and published by rename."""
    root = cached_dir(
        f"bundles/{name}-{bundle_key(manifest_path, *flags)}",
        lambda d: (d / "report.json").write_text(json.dumps(build(d / "bundle"))),
    )
    report = json.loads((root / "report.json").read_text())
    return root / "bundle", report


def build_session_bundle(session_dir: Path, model_dir: Path, name: str, **manifest: Any) -> Any:
    """Write manifest NAME.yaml and build it (with the test cache) into a bundle the test cache
    keeps: a later call, from any xdist worker or a later run, gets the first build back."""
    from neffkit.compile.build import BuildResult, build
    from neffkit.manifest import load_manifest

    path = write_manifest(session_dir / f"{name}.yaml", model_dir, **manifest)

    def make(out: Path) -> dict[str, Any]:
        result = build(
            load_manifest(path), out, jobs=build_jobs_per_worker(), cache=artifact_cache()
        )
        return result.report()

    bundle, report = cached_bundle(session_dir, name, path, (), make)
    return BuildResult(bundle, counters=report["counters"])


def build_jobs_per_worker() -> int:
    """Build workers per test build: the cores shared among the xdist workers."""
    if os.environ.get("NEFFKIT_TEST_JOBS"):
        return int(os.environ["NEFFKIT_TEST_JOBS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    return max(1, (os.cpu_count() or 2) // workers)


# families whose compiled bundles `make test` builds and compares with HF: they also serve the
# runtime, server, build, fp8 and MLA tests. Every family's model code is compared with HF in
# `make test` with nothing compiled (tests/e2e/test_families.py: the graphs a build traces, run
# eagerly); every family's compiled bundle is compared in `make test-all`.
BUNDLES_IN_TEST = ("llama", "llama_tied", "qwen3", "deepseek")
# lowered bundles `make test` builds and runs on XLA:CPU: tp=1 and tp=2, MLA, expert parallelism
LOWERED_IN_TEST = (("llama", 1), ("llama", 2), ("deepseek", 1), ("mixtral", 2))


def full_unless(values: Any, kept: Any) -> list[Any]:
    """pytest params of `values`: those not in `kept` marked `full` (only in `make test-all`)."""
    return [v if v in kept else pytest.param(*_tuple(v), marks=pytest.mark.full) for v in values]


def _tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


TP2_IN_TEST = ("llama",)  # its tp=2 bundle serves the runtime, server and audit tests


# bundles a test module builds for its own tests, registered by `prebuild` for the prebuild:
# name → (builder, its stage)
PREBUILD: dict[str, tuple[Callable[[Path, Callable[[str], Path]], Path], int]] = {}


def prebuild(name: str, stage: int = 0):
    """Register a test module's bundle builder, fn(session_dir, hf_model_dir) → bundle, with the
    prebuild: without it, two workers reaching the module together would both wait on one
    build. `stage` 1: after the shared bundles, whose graphs it shares (cache hits once those
    are built), so no worker compiles them twice side by side; stage 2: after stage 1's."""

    def register(fn: Callable[[Path, Callable[[str], Path]], Path]):
        PREBUILD[name] = (fn, stage)
        return fn

    return register


@contextmanager
def claimed(session_dir: Path, name: str) -> Iterator[bool]:
    """Claim job NAME for this worker, without waiting: yields False if another holds it."""
    claims = session_dir / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    with (claims / f"{name}.lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- neuron: lowered bundles

NEURON = {"target": "neuron", "neuron": {"target": "trn2", "lnc": 2}}
LOWERED = {  # kind, tp → buckets
    ("llama", 1): {"prefill": [16], "decode": [2], "context": [32, 64]},
    ("qwen3", 1): {"prefill": [16], "decode": [2], "context": [64]},
    ("llama", 2): {"prefill": [16], "decode": [2], "context": [64]},
    ("qwen3", 2): {"prefill": [16], "decode": [2], "context": [64]},
    # sinks, sliding + full layers, yarn, biases; decode b1 gathers its routed experts
    ("gpt_oss", 1): {"prefill": [16], "decode": [1], "context": [64]},
    # MLA: latent cache, expanded prefill, absorbed decode; grouped routing, shared expert;
    # packed prefill (two prompts' tokens in one row, per-token sequence ids)
    ("deepseek", 1): {"prefill": [16], "decode": [1], "context": [64], "prefill_batch": [1, 2]},
    # experts over 2 groups (ep=2), each expert's intermediate dimension whole (tp/ep = 1)
    ("mixtral", 2): {"prefill": [16], "decode": [2], "context": [64]},
    # Gemma 3: two rotations, q/k norms, scaled embedding, sliding + full layers
    ("gemma3", 1): {"prefill": [16], "decode": [2], "context": [64]},
    # and at tp=2: each rank's sliding and full KV groups, window-sized caches on every rank
    ("gemma3", 2): {"prefill": [16], "decode": [2], "context": [64]},
    # OLMo 2 at tp=2: its q/k norms all-reduce their sums of squares over the ranks
    ("olmo2", 2): {"prefill": [16], "decode": [2], "context": [64]},
    # Llama 4: chunked and NoPE layers, sigmoid top-1 routing into input-scaled experts
    ("llama4", 1): {"prefill": [16], "decode": [1], "context": [64]},
}
EP = {"mixtral": 2}  # kind → ep at tp > 1


def lowered_build(
    session_dir: Path, model_dir: Path, name: str, *extra: str, **manifest: Any
) -> Path:  # NEURON's chip unless `neuron` is given
    """A neuron build of `model_dir` (`neffkit build ... EXTRA`): from the test cache, where
    traces and their HLO are cached like artifacts, and kept there as a bundle; with
    `--no-cache` in EXTRA, built afresh into the session directory."""
    path = write_manifest(session_dir / f"{name}.yaml", model_dir, **{**NEURON, **manifest})
    if "--no-cache" in extra:
        out = session_dir / "bundles" / name
        run_cli("build", str(path), "-o", str(out), *extra, check=True)
        return out

    def make(out: Path) -> dict[str, Any]:
        args = ("build", str(path), "-o", str(out), "--cache", str(artifact_cache()), "-j", "1")
        args += extra
        return json.loads(run_cli(*args, "--json", check=True).stdout)

    return cached_bundle(session_dir, name, path, extra, make)[0]
