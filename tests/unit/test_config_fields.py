"""Nothing silently ignored: every config field value that changes what a family's HF class
computes is implemented or refused naming the field (a table of family, field, value)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from neffkit.errors import ManifestError, ModelError
from neffkit.models.registry import read_model_config
from tests.support.models import write_manifest

REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    # (test model, config.json changes, the field named, what else the error says)
    ("llama", {"hidden_act": "gelu_fast"}, "hidden_act", "not implemented for LlamaForCausalLM"),
    ("qwen3", {"hidden_act": "tanh"}, "hidden_act", "not implemented for Qwen3ForCausalLM"),
    ("mistral", {"hidden_act": "quick_gelu"}, "hidden_act", "for MistralForCausalLM"),
    ("qwen2", {"hidden_act": "sigmoid"}, "hidden_act", "not implemented for Qwen2ForCausalLM"),
    ("mixtral", {"hidden_act": "mish"}, "hidden_act", "not implemented for MixtralForCausalLM"),
    ("qwen3_moe", {"hidden_act": "elu"}, "hidden_act", "for Qwen3MoeForCausalLM"),
    ("deepseek", {"hidden_act": "leaky_relu"}, "hidden_act", "for DeepseekV3ForCausalLM"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor", "the whole head only"),
    (
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.25,
            }
        },
        "partial_rotary_factor",
        "the whole head only",
    ),
    (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "layer_types": None},
        "use_sliding_window",
        "without layer_types is not implemented",
    ),
    (
        "llama",
        {"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}},
        "rope_parameters.rope_type",
        "'su'",
    ),
    (
        "llama",
        {"quantization_config": {"quant_method": "hqq", "bits": 4}},
        "quantization_config.quant_method",
        "'hqq'",
    ),
    (
        "qwen3",
        {"quantization_config": {"quant_method": "awq", "bits": 3}},
        "quantization_config.bits",
        "3",
    ),
    ("gemma3", {"hidden_activation": "gelu_fast"}, "hidden_activation", "for Gemma3ForCausalLM"),
    (
        "gemma3",
        {"use_bidirectional_attention": True},
        "use_bidirectional_attention",
        "not implemented for Gemma3ForCausalLM",
    ),
    ("gemma2", {"hidden_activation": "silu_fast"}, "hidden_activation", "for Gemma2ForCausalLM"),
    ("phi3", {"hidden_act": "gelu_fast"}, "hidden_act", "not implemented for Phi3ForCausalLM"),
    (
        "phi3",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
            }
        },  # Phi-4-mini's
        "partial_rotary_factor",
        "the whole head only",
    ),
    ("granite", {"hidden_act": "tanh"}, "hidden_act", "not implemented for GraniteForCausalLM"),
    ("olmo", {"hidden_act": "tanh"}, "hidden_act", "not implemented for OlmoForCausalLM"),
    ("olmo2", {"hidden_act": "tanh"}, "hidden_act", "not implemented for Olmo2ForCausalLM"),
    ("cohere", {"hidden_act": "tanh"}, "hidden_act", "not implemented for CohereForCausalLM"),
    ("llama4", {"hidden_act": "tanh"}, "hidden_act", "not implemented for Llama4ForCausalLM"),
    (
        "llama4",
        {"quantization_config": {"quant_method": "fbgemm_fp8"}},
        "quantization_config",
        "not implemented for Llama4ForCausalLM",
    ),
    (
        "llama4",
        {"layer_types": ["sliding_attention", "full_attention"]},
        "layer_types",
        "'sliding_attention' is not implemented for Llama4ForCausalLM",
    ),
    ("llama4", {"no_rope_layers": [1, 0, 1]}, "no_rope_layers", "3 entries for 2 layers"),
    ("llama4", {"attention_chunk_size": None}, "attention_chunk_size", "layer_types has chunked"),
]
IMPLEMENTED: list[tuple[str, str, Any]] = [
    ("llama", "hidden_act", "gelu"),
    ("llama", "hidden_act", "gelu_pytorch_tanh"),
    ("qwen2", "hidden_act", "gelu_new"),
    ("qwen3_moe", "hidden_act", "relu"),
    ("mixtral", "hidden_act", "silu"),
    ("gpt_oss", "hidden_act", "gelu"),  # HF's GptOss reads no hidden_act: its SwiGLU is fixed
    ("llama4", "hidden_act", "gelu"),
]


def _config_dir(tmp_path: Path, source: Path, **changes: Any) -> Path:
    raw = json.loads((source / "config.json").read_text())
    raw.update(changes)
    if "rope_parameters" in changes:
        raw.pop("rope_scaling", None)
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize(("kind", "changes", "field", "says"), REFUSED)
def test_unimplemented_values_are_refused_naming_the_field(
    kind, changes, field, says, hf_model_dir, tmp_path
):
    model = _config_dir(tmp_path, hf_model_dir(kind), **changes)
    with pytest.raises(ModelError) as err:
        read_model_config(model)
    message = err.value.message
    assert field in message and says in message and "config.json" in message, message


@pytest.mark.parametrize(("kind", "field", "value"), IMPLEMENTED)
def test_implemented_values_are_read(kind, field, value, hf_model_dir, tmp_path):
    cfg = read_model_config(_config_dir(tmp_path, hf_model_dir(kind), **{field: value}))
    expected = "silu" if kind == "gpt_oss" else value
    assert cfg.hidden_act == expected


def test_unsupported_architecture_lists_the_supported_and_points_at_the_guide(
    hf_model_dir, tmp_path
):
    model = _config_dir(tmp_path, hf_model_dir("llama"), architectures=["BloomForCausalLM"])
    with pytest.raises(ModelError) as err:
        read_model_config(model)
    assert "'BloomForCausalLM' is not supported" in err.value.message
    assert "LlamaForCausalLM" in err.value.message and "Qwen3MoeForCausalLM" in err.value.message
    assert "docs/adding-a-model.md" in (err.value.hint or "")


def _hub_cache(root: Path, model: Path) -> str:
    """A Hugging Face cache as `snapshot_download` leaves it: org/tiny at one commit, `main`
    and the tag `v1` pointing at it, its files under snapshots/<sha>."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = root / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(sha)
    shutil.copytree(model, repo / "snapshots" / sha)
    return sha


def test_a_hub_id_resolves_through_the_cache_and_a_missing_one_says_where(
    tmp_path, monkeypatch, hf_model_dir
):
    from neffkit.manifest import load_manifest

    sha = _hub_cache(tmp_path / "hf", hf_model_dir("llama"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_manifest(tmp_path / "m.yaml", tmp_path / "unused")
    for model in ("org/tiny", f"org/tiny@{sha}", "org/tiny@v1"):
        path.write_text(path.read_text().replace(str(tmp_path / "unused"), model))
        manifest = load_manifest(path)
        assert manifest.model == tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / sha
        assert manifest.model_revision == sha and manifest.to_json()["model_revision"] == sha
        path.write_text(path.read_text().replace(model, str(tmp_path / "unused")))
    path.write_text(path.read_text().replace(str(tmp_path / "unused"), "org/absent@v2"))
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    message = err.value.message
    assert "org/absent@v2" in message and "Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message and "hf download org/absent" in (err.value.hint or "")
