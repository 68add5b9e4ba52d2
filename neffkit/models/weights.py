"""HF safetensors → the ordered weight list the graphs take as inputs.

Tensors are read one at a time through safetensors' mmap (never the whole checkpoint at once) and
cast to the bundle dtype. Tied embeddings contribute one tensor, not two. Order is fixed here and
recorded in bundle.json; graphs and the runtime both follow it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from neffkit.errors import ModelError
from neffkit.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_OPTIONAL_BIASES = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def checkpoint_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (single file or index-sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir}: no *.safetensors files")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            out.update({name: file for name in handle.keys()})  # noqa: SIM118 (not a dict)
    return out


def weight_names(cfg: ModelConfig, available: set[str]) -> list[str]:
    """The graph's weight inputs in order; optional biases included when the checkpoint has them."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        names.append(f"{p}.input_layernorm.weight")
        for proj in _OPTIONAL_BIASES:
            names.append(f"{p}.self_attn.{proj}.weight")
            if f"{p}.self_attn.{proj}.bias" in available:
                names.append(f"{p}.self_attn.{proj}.bias")
        if cfg.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        names.append(f"{p}.post_attention_layernorm.weight")
        for proj in _MLP:
            names.append(f"{p}.mlp.{proj}.weight")
            if f"{p}.mlp.{proj}.bias" in available:
                names.append(f"{p}.mlp.{proj}.bias")
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    missing = [n for n in names if n not in available]
    if missing:
        raise ModelError(
            f"checkpoint is missing {len(missing)} tensor(s) the model needs, e.g. {missing[0]!r}"
        )
    return names


def iter_weights(
    model_dir: Path, cfg: ModelConfig, dtype: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in graph order, each read lazily and cast to `dtype`."""
    index = checkpoint_index(model_dir)
    torch_dtype = DTYPES[dtype]
    handles: dict[Path, object] = {}
    try:
        for name in weight_names(cfg, set(index)):
            file = index[name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            yield name, handles[file].get_tensor(name).to(torch_dtype).contiguous()
    finally:
        handles.clear()


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: str) -> dict[str, torch.Tensor]:
    return dict(iter_weights(model_dir, cfg, dtype))


def weight_shapes(model_dir: Path, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) in graph order, read from the safetensors headers without loading tensors."""
    index = checkpoint_index(model_dir)
    out = []
    for name in weight_names(cfg, set(index)):
        with safe_open(str(index[name]), framework="pt") as handle:
            out.append((name, tuple(handle.get_slice(name).get_shape())))
    return out
