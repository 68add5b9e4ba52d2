"""HF safetensors → each rank's ordered weight list (the graphs' weight inputs).

Tensors are read one at a time into their own buffers (never the whole checkpoint at once), cut
for the rank by `sharding.rank_weights` and cast to the bundle dtype. Shapes alone come from the
safetensors headers through meta tensors, with the same cutting code. Order is fixed by
`rank_weights` and recorded in bundle.json; graphs and the runtime both follow it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from neffkit.errors import ModelError
from neffkit.models.config import ModelConfig
from neffkit.models.sharding import Parallelism, keeps_float32, rank_weights
from neffkit.tensor_files import TensorReader, read_header

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_dtype(name: str, dtype: str) -> torch.dtype:
    """The bundle dtype, except for tensors that stay float32 (rope frequencies)."""
    return torch.float32 if keeps_float32(name) else DTYPES[dtype]


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
        out.update(dict.fromkeys(read_header(file), file))
    return out


QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I8", "U8")


def _refuse_quantized_tensor(file: Path, name: str, dtype: str) -> None:
    """A quantized tensor widened without its scales is silently wrong: refuse it by name."""
    if dtype.upper() in QUANTIZED_DTYPES:
        raise ModelError(
            f"{file}: tensor {name!r} is stored as {dtype}; quantized checkpoints are not "
            "supported (neffkit reads float32/bfloat16/float16 weights)",
            hint="dequantize the checkpoint first",
        )


def rank_weight_shapes(
    model_dir: Path, cfg: ModelConfig, par: Parallelism, rank: int
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of one rank's weights, from headers only: tracing never needs values."""
    index = checkpoint_index(model_dir)
    shapes: dict[str, list[int]] = {}
    for file in set(index.values()):
        for name, entry in read_header(file).items():
            _refuse_quantized_tensor(file, name, entry["dtype"])
            shapes[name] = entry["shape"]

    def meta(name: str) -> torch.Tensor:
        return torch.empty(shapes[name], device="meta")

    return [(n, tuple(t.shape)) for n, t in rank_weights(cfg, par, rank, meta, set(index))]


def rank_weight_specs(
    model_dir: Path, cfg: ModelConfig, dtype: str, par: Parallelism, rank: int
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, bundle dtype) of one rank's weights, in graph order, from headers only."""
    shapes = rank_weight_shapes(model_dir, cfg, par, rank)
    return [(name, shape, weight_dtype(name, dtype)) for name, shape in shapes]


def iter_rank_weights(
    model_dir: Path, cfg: ModelConfig, dtype: str, par: Parallelism, rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield one rank's (name, tensor) in graph order, read one at a time, cut, cast, compact.

    Each tensor is read into its own buffer (tensor_files.TensorReader, not an mmap), so memory
    holds one tensor and its cast at a time, whatever the checkpoint's size."""
    index = checkpoint_index(model_dir)
    readers: dict[Path, TensorReader] = {}

    def get(name: str) -> torch.Tensor:
        file = index[name]
        if file not in readers:
            readers[file] = TensorReader(file)
        return readers[file].get(name)

    try:
        for name, tensor in rank_weights(cfg, par, rank, get, set(index)):
            cast = tensor.to(weight_dtype(name, dtype))
            # a compact tensor: a slice must not drag its parent's storage into the file
            if not cast.is_contiguous() or cast.untyped_storage().nbytes() != cast.nbytes:
                cast = cast.clone(memory_format=torch.contiguous_format)
            yield name, cast
            del tensor, cast
    finally:
        for reader in readers.values():
            reader.close()
        readers.clear()


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: str) -> dict[str, torch.Tensor]:
    """All weights for tp=1 (tests and tools)."""
    return dict(iter_rank_weights(model_dir, cfg, dtype, Parallelism(), 0))
