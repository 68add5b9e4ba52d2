"""Shared fixtures: tiny random HF checkpoints (the oracle) and bundles built from them once per
session. Builds dominate the suite's time (g++ per graph), so every test reuses these bundles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "models" / "demo-llama"
VOCAB = 1024  # matches the demo tokenizer, so test models can take text prompts

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
)

# kind → (transformers config class, extra config, buckets)
SMALL = {"prefill": [16], "decode": [1, 4], "context": [64]}
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, list[int]]]] = {
    "llama": ("LlamaConfig", {}, {"prefill": [16], "decode": [1, 4], "context": [32, 64]}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}, SMALL),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, SMALL),
    "mistral": ("MistralConfig", {"sliding_window": 24}, SMALL),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 1}, SMALL),  # MQA + qkv bias
    # layer 0 dense, layer 1 sparse; renormalised top-2 of 4 experts
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
        },
        SMALL,
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, SMALL),
}
# kind → (parallel layout, buckets) of the tp > 1 bundles
PARALLEL: dict[str, tuple[dict[str, int], dict[str, list[int]]]] = {
    "llama": ({"tp": 2}, {"prefill": [16], "decode": [1, 4], "context": [256]}),
    "qwen3": ({"tp": 2}, SMALL),
    "qwen2": ({"tp": 2}, SMALL),  # one KV head: replicated on both ranks
    "qwen3_moe": ({"tp": 2, "ep": 2}, SMALL),
    "mixtral": ({"tp": 2, "ep": 2}, SMALL),
}


def run_cli(*args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "neffkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"neffkit {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def run_json(*args: str) -> dict[str, Any]:
    return json.loads(run_cli(*args, "--json", check=True).stdout)


def bundle_json(path: Path) -> dict[str, Any]:
    """bundle.json of a bundle, opened (and every file verified) through the typed record."""
    from neffkit.bundle import read_bundle

    return read_bundle(path).record.to_json()


def session_cache(session_dir: Path) -> Path:
    """One artifact cache for the whole session: rebuilds in tests reuse its entries."""
    return session_dir / "cache"


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("neffkit")


def make_hf_model(kind: str, out: Path, seed: int = 0) -> Path:
    import transformers

    config_cls, extra, _ = MODELS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEMO_MODEL / name, out / name)
    return out


@pytest.fixture(scope="session")
def hf_model_dir(session_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_hf_model(kind, session_dir / "models" / kind)
        return made[kind]

    return get


def write_manifest(path: Path, model_dir: Path, **overrides: Any) -> Path:
    data: dict[str, Any] = {
        "neffkit": 1,
        "name": path.stem,
        "model": str(model_dir),
        "kv_cache": {"block_size": 16},
        "buckets": SMALL,
        "sampling": {"max_top_k": 16},
    }
    data.update(overrides)
    path.write_text(yaml.safe_dump(data))
    return path


def build_session_bundle(session_dir: Path, model_dir: Path, name: str, **manifest: Any) -> Any:
    """Write manifest NAME.yaml and build it into bundles/NAME with the session's cache."""
    from neffkit.compile.build import build
    from neffkit.manifest import load_manifest

    path = write_manifest(session_dir / f"{name}.yaml", model_dir, **manifest)
    jobs = int(os.environ.get("NEFFKIT_TEST_JOBS", os.cpu_count() or 2))
    return build(
        load_manifest(path),
        session_dir / "bundles" / name,
        jobs=jobs,
        cache_dir=session_cache(session_dir),
    )


@pytest.fixture(scope="session")
def bundle(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Callable[[str], Path]:
    """kind → a bundle built from that kind's tiny checkpoint (built once per session)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            result = build_session_bundle(
                session_dir, hf_model_dir(kind), kind, buckets=MODELS[kind][2]
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


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[int], int], list[int]]:
    """The oracle: HF transformers greedy generate on the saved checkpoint."""
    import transformers

    models: dict[Path, Any] = {}

    def run(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        if model_dir not in models:
            models[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        ids = torch.tensor([prompt])
        out = models[model_dir].generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        return out[0, len(prompt) :].tolist()

    return run
