"""Checkpoint reading: config variants and safetensors layouts, checked against HF's own files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from neffkit.models.registry import read_model_config
from neffkit.models.weights import load_weights


def test_index_sharded_checkpoint_loads_the_same_tensors(hf_model_dir, tmp_path):
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    single = hf_model_dir("llama")
    sharded = tmp_path / "sharded"  # HF's own writer of index-sharded checkpoints
    shutil.copytree(single, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    save_torch_state_dict(load_file(single / "model.safetensors"), sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    cfg = read_model_config(single)
    a, b = load_weights(single, cfg, "float32"), load_weights(sharded, cfg, "float32")
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rope_theta_from_4x_and_5x_configs(hf_model_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(hf_model_dir("qwen3"), model_dir)
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 123456.0  # transformers 4.x puts it at the top level
    path.write_text(json.dumps(cfg))
    assert read_model_config(model_dir).rope_theta == 123456.0
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    path.write_text(json.dumps(cfg))
    parsed = read_model_config(model_dir)
    assert parsed.rope_theta == 5e5
    assert (parsed.head_dim, parsed.qk_norm) == (32, True)


ROPE_CASES = {  # rope parameters as transformers 5.x spells them (4.x: rope_scaling, below)
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 64,
    },
    "yarn_no_truncate": {
        "rope_type": "yarn",
        "factor": 4.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("spelling", ["5.x", "4.x"])
def test_rope_frequencies_equal_transformers_bit_for_bit(case, spelling):
    """inv_freq and the attention factor equal transformers' ROPE_INIT_FUNCTIONS exactly (the
    definition), read from either config spelling."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from neffkit.models.config import rope_parameters
    from neffkit.models.rope_scaling import rope_frequencies

    params = {**ROPE_CASES[case], "rope_theta": 5e4}
    common = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    hf = transformers.LlamaConfig(**common, rope_parameters=dict(params))
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    if spelling == "5.x":
        config = {**common, "rope_parameters": params}
    else:
        old = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
        config = {**common, "rope_theta": 5e4, "rope_scaling": {"type": params["rope_type"], **old}}
    inv_freq, factor = rope_frequencies(rope_parameters(config, "config.json"), 16)
    assert torch.equal(inv_freq, want) and factor == want_factor


def test_mqa_and_tied_configs(hf_model_dir):
    assert read_model_config(hf_model_dir("qwen2")).num_kv_heads == 1
    assert read_model_config(hf_model_dir("llama_tied")).tie_word_embeddings
    assert read_model_config(hf_model_dir("mistral")).sliding_windows == (24, 24)


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq' is not supported"),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            "'gemv' is not supported",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
            "desc_act: true",
        ),
        # compressed-tensors' other layouts (2:4 sparsity, nvfp4) are refused by name
        (
            {"quant_method": "compressed-tensors", "format": "sparse-24-bitmask"},
            "format 'sparse-24-bitmask' is not supported",
        ),
        # DeepSeek's fp8 without its block shape: nothing says how the scales map to blocks
        (
            {"quant_method": "fp8", "activation_scheme": "static"},
            "weight_block_size: None is not a block shape",
        ),
    ],
)
def test_unimplemented_quantization_is_refused_by_method(hf_model_dir, tmp_path, quant, message):
    """Widening a method's tensors without their scales would build a bundle that generates
    garbage: a config neffkit does not implement is refused naming the method."""
    from neffkit.errors import ModelError

    model_dir = tmp_path / "m"
    shutil.copytree(hf_model_dir("llama"), model_dir)
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = quant
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=message):
        read_model_config(model_dir)


def test_fp8_tensors_without_a_quantization_config_are_refused(hf_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from neffkit.errors import ModelError
    from neffkit.models.parallel import Parallelism
    from neffkit.models.weights import rank_weight_shapes

    model_dir = tmp_path / "m"
    shutil.copytree(hf_model_dir("llama"), model_dir)
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, file, metadata={"format": "pt"})
    cfg = read_model_config(model_dir)
    with pytest.raises(ModelError, match=f"tensor '{name}' is stored as F8_E4M3"):
        rank_weight_shapes(model_dir, cfg, Parallelism(tp=1), 0)


def test_streamed_safetensors_round_trip_through_the_reference_library(hf_model_dir, tmp_path):
    """tensor_files writes one tensor at a time, reads without an mmap (the build) and maps a
    whole file (the runtime); safetensors' own reader and writer are the oracle for the format."""
    from safetensors.torch import load_file

    from neffkit.contract.tensor_files import TensorReader, map_tensors, write_tensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(7, generator=gen),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
    }
    specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    path = tmp_path / "x.safetensors"
    assert write_tensors(path, specs, iter(tensors.items())) == list(tensors)
    loaded = load_file(path)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    mapped = map_tensors(path)  # the runtime's loader: views of one mapping, each aligned
    assert all(torch.equal(mapped[n], t) for n, t in tensors.items())
    assert all(t.data_ptr() % t.element_size() == 0 for t in mapped.values() if t.numel())
    reference = hf_model_dir("llama") / "model.safetensors"
    reader, expected = TensorReader(reference), load_file(reference)
    try:
        assert all(torch.equal(reader.get(n), t) for n, t in expected.items())
    finally:
        reader.close()
    with pytest.raises(ValueError, match="expected b"):
        write_tensors(path, specs, iter([("a", tensors["a"]), ("b", tensors["a"])]))


def test_vocab_parallel_shards_cover_the_vocabulary_once(hf_model_dir):
    """tp > 1: each rank keeps ceil(vocab / tp) rows of the embedding (and an untied LM head);
    the shards laid end to end are the table, the last one zero-padded."""
    from neffkit.models.parallel import Parallelism
    from neffkit.models.weights import iter_rank_weights

    model_dir = hf_model_dir("qwen2")  # vocab 1027: tp=2 does not divide it
    cfg = read_model_config(model_dir)
    full = load_weights(model_dir, cfg, "float32")
    par = Parallelism(tp=2)
    rows = cfg.vocab_rows(par)
    assert rows == 514
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        shards = [dict(iter_rank_weights(model_dir, cfg, "float32", par, r))[name] for r in (0, 1)]
        assert [s.shape[0] for s in shards] == [rows, rows]
        joined = torch.cat(shards)
        assert torch.equal(joined[: cfg.vocab_size], full[name])
        assert not joined[cfg.vocab_size :].any()
