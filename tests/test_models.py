"""Checkpoint reading: config variants and safetensors layouts, checked against HF's own files."""

from __future__ import annotations

import json
import shutil

import torch

from neffkit.models.config import read_model_config
from neffkit.models.weights import load_weights


def test_index_sharded_checkpoint_loads_the_same_tensors(hf_model_dir, tmp_path):
    import transformers

    single = hf_model_dir("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
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


def test_mqa_and_tied_configs(hf_model_dir):
    assert read_model_config(hf_model_dir("qwen2")).num_kv_heads == 1
    assert read_model_config(hf_model_dir("llama_tied")).tie_word_embeddings
    assert read_model_config(hf_model_dir("mistral")).sliding_windows == (24, 24)
