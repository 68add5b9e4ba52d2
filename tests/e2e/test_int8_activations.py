"""`quantization.activations: int8`: integer weights multiplied by int8 activations quantized per
block of 32 inputs (llama.cpp's arithmetic for its quantized formats), opt-in by the manifest.

The oracle is HF transformers on the checkpoint's float twin with every projection's input
quantized per block in numpy (scale absmax / 127, values rint(x * (127 / absmax)), back to float
as values times scale) by a forward pre-hook: the product of the quantized rows and the weight's
exact values. The bundle computes it either in the graph (the same quantized rows through the
weight-only forms) or through neffkit::int8_blocks (int32 sums), in another float32 rounding;
greedy tokens must be HF's either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neffkit.errors import ManifestError
from tests.support.bundles import build_session_bundle
from tests.support.cli import run_ids
from tests.support.models import LONG, MAX_NEW, MIXED, SHORT, hf_greedy_ids, write_manifest

ONE_DECODE = {"prefill": [16], "decode": [1, 4], "context": [64]}
PROMPTS = [SHORT, LONG, *MIXED]


def _quantized_rows(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A projection's input quantized per block of 32 and dequantized, in numpy float32."""
    x = args[0].detach().numpy().astype(np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.clip(np.rint(blocks * inverse), -127, 127)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1))
    return (torch.from_numpy((q * scale).reshape(x.shape).astype(np.float32)), *args[1:])


def _reference(twin: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy on the twin, every linear layer (the projections and the LM head) reading its
    input quantized per block."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    hooked = 0
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(_quantized_rows)
            hooked += 1
    assert hooked > 0
    return [hf_greedy_ids(hf, prompt, MAX_NEW) for prompt in prompts]


def _bundle_record(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "bundle.json").read_text())


@pytest.mark.parametrize("kernel", ["off", "auto"])
def test_gguf_with_int8_activations_equals_hf_on_quantized_rows(
    kernel, tiny_gguf, session_dir, hf_greedy
):
    """The tiny GGUF mixes 4-, 5-, 6- and 8-bit types: the 4- and 8-bit ones take the kernel
    (kernel auto), the 5- and 6-bit ones the weight-only forms on the quantized rows."""
    path, twin = tiny_gguf
    result = build_session_bundle(
        session_dir,
        path,
        f"gguf_int8_act_{kernel}",
        buckets=ONE_DECODE,
        quantization={"activations": "int8"},
        compiler={"cpu_kernel": kernel},
    )
    want = _reference(twin, PROMPTS)
    assert run_ids(result.bundle, PROMPTS) == want
    assert want != [hf_greedy(twin, p, MAX_NEW) for p in PROMPTS]  # the rows' quantization shows
    record = _bundle_record(result.bundle)
    schemes = dict(record["model"]["weight_quant"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert schemes[q].endswith(":a:int8-block")
    assert all(s.endswith(":a:int8-block") for n, s in schemes.items() if "_proj" in n)
    forms = {g["name"]: g["projection"] for g in record["graphs"]}
    has_kernel = any("kernel-int8" in f for f in forms.values())
    assert has_kernel == (kernel == "auto"), forms


def test_manifest_int4_with_int8_activations_equals_hf(hf_model_dir, session_dir):
    """A float checkpoint quantized by the manifest (int4, groups of 32) with int8 rows: the
    twin is the checkpoint's int4 values (the quantization tests' twin)."""
    from tests.e2e.test_quantization import twin as int_twin

    model = hf_model_dir("llama")
    result = build_session_bundle(
        session_dir,
        model,
        "llama_int4_int8_act",
        buckets=ONE_DECODE,
        quantization={"weights": "int4", "group_size": 32, "activations": "int8"},
    )
    twin = int_twin(model, 4, 32, ())
    assert run_ids(result.bundle, PROMPTS) == _reference(twin, PROMPTS)


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"activations": "int8"}, "int8 activations are for integer weights"),
        ({"activations": "int4"}, "quantization.activations: 'int4' is not supported"),
        ({"weights": "int8", "activations": "fp8"}, "quantization.activations"),
    ],
)
def test_activations_refused_where_no_integer_weight_reads_them(
    quantization, message, hf_model_dir, tmp_path
):
    from neffkit.manifest import load_manifest

    path = write_manifest(tmp_path / "m.yaml", hf_model_dir("llama"), quantization=quantization)
    with pytest.raises(ManifestError, match=message):
        load_manifest(path)
