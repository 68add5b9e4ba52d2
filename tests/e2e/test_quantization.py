"""The manifest's weight quantization of a float checkpoint (`quantization: {weights: int8}` /
`{weights: int4, group_size: N}`): the bundle keeps uint8 codes and float32 group scales, and its
greedy tokens equal HF float32 on the twin whose weights are exactly the quantized values
(quantized here by the formula the docs give, not by neffkit's code).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support.bundles import build_session_bundle
from tests.support.cache import cached_dir
from tests.support.cli import run_ids
from tests.support.models import COMMON, LONG, MAX_NEW, MIXED, SHORT

ONE_DECODE = {"prefill": [16], "decode": [1], "context": [64]}


def symmetric(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """w quantized and widened: per group of `group` inputs (0: the row), scale absmax /
    (2^(bits-1) - 1), round half to even, clamp to the signed range."""
    w = w.float()
    g = group or w.shape[-1]
    blocks = w.reshape(*w.shape[:-1], -1, g)
    qmax = 2 ** (bits - 1) - 1
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(blocks / scale).clamp(-qmax - (bits == 4), qmax)
    return (q * scale).reshape(w.shape)


def twin(model_dir: Path, bits: int, group: int, exclude: tuple[str, ...] = ()) -> Path:
    """The checkpoint with every projection and the LM head (a tied table with it) replaced by
    its quantized values, less `exclude` (module names), made once per machine."""
    from safetensors.torch import load_file, save_file

    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings")

    def make(out: Path) -> None:
        shutil.copytree(model_dir, out, dirs_exist_ok=True)
        tensors = load_file(model_dir / "model.safetensors")
        for name, value in tensors.items():
            base = name.removesuffix(".weight")
            head = base == "lm_head" or (tied and base == "model.embed_tokens")
            chosen = name.endswith("_proj.weight") or head
            if chosen and not any(base.endswith(e) or (head and e == "lm_head") for e in exclude):
                tensors[name] = symmetric(value, bits, group)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    tag = f"{model_dir.name}-int{bits}-g{group}-{'-'.join(exclude) or 'all'}"
    return cached_dir(f"models/twin-{tag}", make)


def _stored(bundle: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(bundle / "weights" / "rank0.safetensors"), "pt") as f:
        return {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118


def test_int4_groups_keep_four_bits_and_equal_hf_on_the_quantized_values(
    hf_model_dir, session_dir, hf_greedy
):
    model = hf_model_dir("llama")
    result = build_session_bundle(
        session_dir,
        model,
        "int4_g32",
        buckets=ONE_DECODE,
        quantization={"weights": "int4", "group_size": 32},
    )
    prompts = [SHORT, LONG, *MIXED]
    oracle = twin(model, 4, 32)
    assert run_ids(result.bundle, prompts) == [hf_greedy(oracle, p, MAX_NEW) for p in prompts]
    stored = _stored(result.bundle)
    hidden = COMMON["hidden_size"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert stored[q] == ("U8", [hidden, hidden // 2])  # two codes a byte
    assert stored[q + ".qscale"] == ("F32", [hidden, hidden // 32])
    assert stored["lm_head.weight"][0] == "U8"
    assert stored["model.embed_tokens.weight"][0] == "F32"  # untied: a lookup, not quantized
    assert stored["model.norm.weight"][0] == "F32"


@pytest.mark.full  # the int8 and tp=2 variants of the parity above
@pytest.mark.parametrize("tp", [1, 2])
def test_int8_channels_on_a_tied_model_less_the_head(tp, hf_model_dir, session_dir, hf_greedy):
    """int8 per output channel at tp=1 and 2 (row-parallel cuts keep whole rows' scales), the
    tied table (the LM head) excluded and left in float."""
    model = hf_model_dir("llama_tied")
    result = build_session_bundle(
        session_dir,
        model,
        f"int8_tied_tp{tp}",
        buckets=ONE_DECODE,
        parallel={"tp": tp},
        quantization={"weights": "int8", "exclude": ["lm_head"]},
    )
    prompts = [SHORT, LONG, *MIXED]
    oracle = twin(model, 8, 0, exclude=("lm_head",))
    assert run_ids(result.bundle, prompts) == [hf_greedy(oracle, p, MAX_NEW) for p in prompts]
    stored = _stored(result.bundle)
    assert stored["model.embed_tokens.weight"][0] == "F32"
    assert stored["model.layers.1.mlp.down_proj.weight"][0] == "U8"
