"""A GGUF file given directly as `model:` builds with its tensors kept quantized and matches HF.

The file is a tiny random Llama written by gguf-py (tests/support/gguf_files.py) mixing Q4_K,
Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 over its projections, embedding and LM head, with F32 and
F16 norms. The oracle is HF transformers on `neffkit convert`'s float32 copy of the same file:
gguf-py's dequantized values through transformers' own GGUF loader (unit tests check that the
copy equals the source tensor for tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.support.bundles import build_session_bundle
from tests.support.cli import run_ids
from tests.support.models import LONG, MAX_NEW, MIXED, SHORT

ONE_DECODE = {"prefill": [16], "decode": [1], "context": [64]}


def _weight_bytes(bundle: Path) -> int:
    return sum(f.stat().st_size for f in (bundle / "weights").glob("*.safetensors"))


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.full)])
def test_gguf_file_builds_quantized_and_equals_hf(tp, tiny_gguf, session_dir, hf_greedy):
    """tp=2 cuts K-quant weights both ways: q/k/gate/up by rows, o/down (Q4_K in layer 1)
    through their inputs, on group boundaries."""
    from neffkit.runtime.tokenizer import Tokenizer

    path, twin = tiny_gguf
    result = build_session_bundle(
        session_dir, path, f"gguf_tiny_tp{tp}", buckets=ONE_DECODE, parallel={"tp": tp}
    )
    prompts = [SHORT, LONG, *MIXED]
    assert run_ids(result.bundle, prompts) == [hf_greedy(twin, p, MAX_NEW) for p in prompts]
    with safe_open(str(result.bundle / "weights" / "rank0.safetensors"), "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
    q = "model.layers.0.self_attn.q_proj.weight"  # Q4_K: 4-bit codes, scales and minimums
    assert dtypes[q] == "U8" and dtypes[q + ".qscale"] == "F32" and q + ".qmin" in dtypes
    assert "model.layers.0.mlp.down_proj.weight.qhigh" in dtypes  # Q6_K: 6 bits a weight
    # Q5_0 / Q5_1 (groups of 32) stored a code a byte, the same values: the kernels read 8 bits
    schemes = dict(json.loads((result.bundle / "bundle.json").read_text())["model"]["weight_quant"])
    assert schemes["model.layers.1.self_attn.k_proj.weight"] == "sym:b8:g32:z16"
    assert schemes["model.layers.1.self_attn.v_proj.weight"] == "min:b8:g32"
    assert dtypes["model.norm.weight"] == "F32"
    float32 = sum(p.numel() * 4 for p in _float_params(twin))
    assert _weight_bytes(result.bundle) <= 0.4 * float32  # all ranks together
    tok = Tokenizer.from_dir(result.bundle / "tokenizer")
    hf_tok = _hf_tokenizer(path)
    for text in ["Hello world, this is a test.", "The quick brown fox"]:
        assert tok.encode(text, False) == hf_tok.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert tok.encode_chat(messages) == list(ids["input_ids"])


def _float_params(model_dir: Path) -> list:
    from safetensors.torch import load_file

    return list(load_file(str(model_dir / "model.safetensors")).values())


def _hf_tokenizer(path: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
