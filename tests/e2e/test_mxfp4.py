"""GPT-OSS in its mxfp4 release layout: the experts stay 4-bit in the bundle (packed e2m1 codes
and a float32 scale per 32 inputs) and the greedy tokens equal HF's on the float twin, whose
experts are transformers' own widening of the same blocks (tests/support/mxfp4.py).

Decode [1] gathers each token's 2 of 8 experts, widened inside the gather; prefill runs every
expert densely. tp=2 (in `make test-all`) cuts each expert's intermediate dimension in half, on
a group boundary of `down_proj`'s groups; ep=2 gives each rank 4 whole experts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from tests.support.bundles import build_session_bundle, prebuild
from tests.support.cli import bundle_json
from tests.support.cli import run_ids as _run
from tests.support.models import LONG, MAX_NEW, MIXED, SHORT
from tests.support.mxfp4 import CONFIG, mxfp4_models

BUCKETS = {"prefill": [16], "decode": [1], "context": [64]}
LAYOUTS = {"tp1": {"tp": 1}, "tp2": {"tp": 2}, "tp2_ep2": {"tp": 2, "ep": 2}}


def _build(session_dir: Path, layout: str) -> Path:
    mx, _ = mxfp4_models()
    name = f"gpt_oss_mxfp4_{layout}"
    parallel = LAYOUTS[layout]
    return build_session_bundle(session_dir, mx, name, buckets=BUCKETS, parallel=parallel).bundle


@prebuild("gpt_oss_mxfp4_tp1")
def build_mxfp4_bundle(session_dir: Path, hf_model_dir) -> Path:
    return _build(session_dir, "tp1")


@pytest.mark.parametrize(
    "layout",
    [
        "tp1",
        pytest.param("tp2", marks=pytest.mark.full),
        pytest.param("tp2_ep2", marks=pytest.mark.full),
    ],
)
def test_mxfp4_gpt_oss_equals_hf_on_the_float_twin(layout, session_dir, hf_greedy):
    _, twin = mxfp4_models()
    bundle = _build(session_dir, layout)
    prompts = [SHORT, LONG, *MIXED]
    assert _run(bundle, prompts) == [hf_greedy(twin, p, MAX_NEW) for p in prompts]
    # every rank stores its experts' codes two a byte and one float32 scale per 32 inputs
    par = LAYOUTS[layout]
    experts = CONFIG["num_local_experts"] // par.get("ep", 1)
    inter = CONFIG["intermediate_size"] // (par["tp"] // par.get("ep", 1))
    hidden = CONFIG["hidden_size"]
    want = {
        "moe.gate_up": ("U8", [experts, 2 * inter, hidden // 2]),
        "moe.gate_up.qscale": ("F32", [experts, 2 * inter, hidden // 32]),
        "moe.down": ("U8", [experts, hidden, inter // 2]),
        "moe.down.qscale": ("F32", [experts, hidden, inter // 32]),
        "moe.down_bias": ("F32", [experts, hidden]),
    }
    for rank in range(par["tp"]):
        with safe_open(str(bundle / "weights" / f"rank{rank}.safetensors"), "pt") as f:
            for layer in range(CONFIG["num_hidden_layers"]):
                for suffix, (dtype, shape) in want.items():
                    t = f.get_slice(f"model.layers.{layer}.{suffix}")
                    assert (t.get_dtype(), t.get_shape()) == (dtype, shape), (rank, suffix)
    quant = dict(bundle_json(bundle)["model"]["weight_quant"])
    assert quant == {
        f"model.layers.{i}.moe.{w}": "e2m1:b4:g32" for i in (0, 1) for w in ("gate_up", "down")
    }
