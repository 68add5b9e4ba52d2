"""compressed-tensors integer checkpoints (llm-compressor's W4A16, W8A16, W8A8) stay at their
width in the bundle and generate what the oracle generates.

The checkpoints are written by compressed-tensors itself (tests/support/compressed_int.py) and
the oracle is HF transformers on the float twin, whose weights are exactly the library's own
decompression of what the checkpoint stores. Weight-only schemes widen in the graph to those
values, so greedy tokens are HF's. W8A8 also quantizes each projection's input per token, which
HF does not: its reference is HF on the twin with every quantized projection computed as vLLM
computes it (numpy, below), and its agreement with the twin itself is measured too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from neffkit.platform import cpu_kernels
from tests.support.bundles import build_session_bundle
from tests.support.cli import bundle_json, run_ids
from tests.support.compressed_int import CONFIG, compressed_models
from tests.support.models import LONG, MAX_NEW, MIXED, SHORT, hf_greedy_ids

BUCKETS = {"prefill": [16], "decode": [1], "context": [64]}
PROMPTS = [SHORT, LONG, *MIXED]
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _stored(bundle: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(bundle / "weights" / "rank0.safetensors"), "pt") as f:
        return {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(
    ("recipe", "tp", "codes", "aux"),
    [
        pytest.param(  # AWQ's build covers this layout in the default suite
            "w4a16_asym_g128",
            1,
            [256, 128],
            {".qscale": [256, 2], ".qzero": [256, 2]},
            marks=pytest.mark.full,
        ),
        pytest.param(
            "w4a16_asym_g128",
            2,
            [128, 128],
            {".qscale": [128, 2], ".qzero": [128, 2]},
            marks=pytest.mark.full,
        ),
        pytest.param("w8a16_channel", 1, [256, 256], {".qscale": [256, 1]}, marks=pytest.mark.full),
    ],
)
def test_weight_only_bundles_equal_hf_on_the_twin(recipe, tp, codes, aux, session_dir, hf_greedy):
    """4-bit codes two a byte with a float32 scale and zero point per group of 128 (hidden 256:
    two groups a row; at tp=2 o_proj and down_proj are cut across their inputs on group
    boundaries); 8-bit codes a byte with one scale a row. The ignored lm_head stays float."""
    ct, twin = compressed_models(recipe)
    result = build_session_bundle(
        session_dir, ct, f"ct_{recipe}_tp{tp}", buckets=BUCKETS, parallel={"tp": tp}
    )
    assert run_ids(result.bundle, PROMPTS) == [hf_greedy(twin, p, MAX_NEW) for p in PROMPTS]
    stored = _stored(result.bundle)
    assert stored[Q_PROJ] == ("U8", codes)
    assert {s: stored[Q_PROJ + s] for s in (".qscale", ".qzero") if Q_PROJ + s in stored} == {
        s: ("F32", shape) for s, shape in aux.items()
    }
    assert stored["lm_head.weight"][0] == "F32"


def _vllm_linear(weight: np.ndarray, scale: np.ndarray) -> Any:
    """A W8A8 projection as vLLM computes it, in numpy: dynamic_scaled_int8_quant (scale
    absmax / 127, values rint(x * (127 / absmax))), the int8 dot products (exact here: every
    sum is below 2^24), and cutlass_scaled_mm's epilogue x_scale * (w_scale * acc) in float32."""
    w = weight.astype(np.float32).T
    w_scale = scale.astype(np.float32).reshape(-1)

    def forward(x: torch.Tensor) -> torch.Tensor:
        xf = x.detach().numpy().astype(np.float32)
        amax = np.abs(xf).max(-1, keepdims=True)
        inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
        q = np.clip(np.rint(xf * inverse), -128, 127)
        return torch.from_numpy(amax / np.float32(127) * (w_scale * (q @ w)))

    return forward


def _w8a8_reference(ct: Path, twin: Path) -> list[list[int]]:
    """HF greedy on the twin with each quantized projection replaced by `_vllm_linear` over
    the checkpoint's own int8 weights and scales; everything else is HF's float32."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with safe_open(str(ct / "model.safetensors"), "np") as f:
        quantized = [n.removesuffix(".weight_scale") for n in f.keys() if n.endswith("_scale")]  # noqa: SIM118
        for name in quantized:
            module = hf.get_submodule(name)
            module.forward = _vllm_linear(
                f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale")
            )
    assert len(quantized) == 7 * CONFIG["num_hidden_layers"]
    return [hf_greedy_ids(hf, prompt, MAX_NEW) for prompt in PROMPTS]


def test_w8a8_bundle_equals_vllms_arithmetic_and_agrees_with_the_twin(session_dir, hf_greedy):
    """Greedy tokens equal the numpy reference's exactly: where the kernel library is in use
    (cpu_kernel: auto) every graph's projections go through neffkit::int8_rows ("kernel-int8":
    int32 sums, the library shipped in the bundle), else the graph's float32 matmul. Against
    the twin (activations not quantized) agreement is counted per position with the twin's own
    tokens as the prefix: free-running greedy on a random model diverges for good at its first
    near tie (measured below 90% here), which says nothing about the next tokens."""
    ct, twin = compressed_models("w8a8")
    result = build_session_bundle(session_dir, ct, "ct_w8a8", buckets=BUCKETS)
    stored = _stored(result.bundle)
    assert stored[Q_PROJ] == ("U8", [256, 256]) and stored[Q_PROJ + ".qscale"] == ("F32", [256, 1])
    record = bundle_json(result.bundle)
    kernel = cpu_kernels.supported()
    forms = {g["name"]: g["projection"].split("+") for g in record["graphs"]}
    assert all(("kernel-int8" in f) == kernel for f in forms.values()), forms
    assert record["kernels"] == (["kernels/libneffkit_cpu.so"] if kernel else [])
    got = run_ids(result.bundle, PROMPTS)
    assert got == _w8a8_reference(ct, twin)
    want = [hf_greedy(twin, p, MAX_NEW) for p in PROMPTS]
    prefixes = [p + w[:k] for p, w in zip(PROMPTS, want, strict=True) for k in range(MAX_NEW)]
    forced = [t[0] for t in run_ids(result.bundle, prefixes, 1)]
    same = sum(a == b for a, b in zip(forced, [t for w in want for t in w], strict=True))
    free = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    print(f"W8A8 vs twin: {same}/{len(forced)} next tokens on its prefixes, {free} free-running")
    assert same / len(forced) >= 0.9
