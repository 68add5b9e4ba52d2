"""A GGUF file as a checkpoint source, its tensors kept at their width.

The model directory is gguf_dir.py's (its pointer names the file and every tensor's byte range):
tensors are read from a memory map of the file under their HF names. Float ones (F32, F16, BF16)
come as float32 through transformers' processor of the architecture, exactly as its GGUF loader
makes them (Gemma's norms included); quantized ones as `QuantTensor`s decoded from their blocks
(gguf_blocks.py), with the rows reordered as the processor reorders them (Llama's q/k rope
permutation), codes, scales and minimums alike.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neffkit.checkpoints.gguf import processor_for
from neffkit.checkpoints.gguf_blocks import BLOCK_TYPES, decode_blocks
from neffkit.checkpoints.gguf_dir import (
    CONVERT_HINT,
    FLOAT_TYPES,
    check_record,
    content_sha,
    read_pointer,
    row_order,
)
from neffkit.checkpoints.quantized import QuantTensor, Source, Tensor
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme


def gguf_source(model_dir: Path) -> Source | None:
    """The GGUF file a model directory stands for (None: a safetensors checkpoint)."""
    record = read_pointer(model_dir)
    return GgufSource(record) if record is not None else None


class GgufSource:
    """The tensors of one GGUF file under their HF names (checkpoints.quantized.Source)."""

    def __init__(self, record: dict[str, Any]) -> None:
        check_record(record)
        self.path = Path(record["gguf"])
        try:
            same = self.path.stat().st_size == record["size"] and (
                content_sha(self.path) == record["sha256"]
            )
        except OSError:
            same = False
        if not same:
            raise ModelError(
                f"{self.path}: the GGUF file is gone or changed since neffkit read it",
                hint="give the file as `model:` again (the manifest reads it anew)",
            )
        self.record = record
        self.tensors: dict[str, dict[str, Any]] = record["tensors"]
        self.names = set(self.tensors)
        self.data: np.ndarray | None = None
        self.processor: Any = None
        self.recent: OrderedDict[str, QuantTensor] = OrderedDict()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> str:
        return "F32" if self.tensors[name]["type"] in FLOAT_TYPES else "Q"

    def scheme(self, name: str) -> QuantScheme | None:
        kind = BLOCK_TYPES.get(self.tensors[name]["type"])
        return kind.scheme if kind is not None else None

    def _raw(self, entry: dict[str, Any]) -> np.ndarray:
        """The tensor's bytes, [..., rows, bytes per row] (a view of the memory map)."""
        if self.data is None:
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self.data[entry["offset"] : entry["offset"] + entry["nbytes"]]
        shape = entry["shape"]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return raw.reshape(*shape[:-1], entry["nbytes"] // rows)

    def _processor(self) -> Any:
        if self.processor is None:
            config = self.record["processor_config"]
            self.processor = processor_for(self.record["architecture"], config)
        return self.processor

    def read(self, name: str) -> Tensor:
        entry = self.tensors[name]
        if entry["type"] in FLOAT_TYPES:
            return self._float(entry)
        if name in self.recent:  # the weight pipeline reads each weight once per part
            self.recent.move_to_end(name)
            return self.recent[name]
        tensor = decode_blocks(self._raw(entry), entry["type"], tuple(entry["shape"]))
        names = {entry["name"]: name}
        try:
            order = row_order(self._processor(), entry["name"], self.shape(name), names, "Q")
        except ValueError as exc:  # made before the processor changed (transformers upgraded)
            raise ModelError(f"{self.path}: tensor {entry['name']!r} {exc}", CONVERT_HINT) from None
        if order is not None:
            tensor = _reorder(tensor, torch.from_numpy(order))
        tensor.check(name)
        self.recent[name] = tensor
        if len(self.recent) > 8:
            self.recent.popitem(last=False)
        return tensor

    def _float(self, entry: dict[str, Any]) -> torch.Tensor:
        """float32, through the processor as transformers' loader has it (gguf-py widens)."""
        import gguf

        kind = gguf.GGMLQuantizationType[entry["type"]]
        weights = gguf.dequantize(np.asarray(self._raw(entry)), kind)
        result = self._processor().process(
            weights=weights,
            name=entry["name"],
            tensor_key_mapping={entry["name"]: entry["name"]},
            parsed_parameters={"tensors": {}, "config": {}},
        )
        values = np.ascontiguousarray(result.weights, dtype=np.float32)
        return torch.from_numpy(values.copy()).reshape(entry["shape"])

    def close(self) -> None:
        self.data = None
        self.recent.clear()


def _reorder(tensor: QuantTensor, order: torch.Tensor) -> QuantTensor:
    """The tensor with its rows (over all leading dims) in `order`: every part alike."""

    def rows(part: torch.Tensor) -> torch.Tensor:
        flat = part.reshape(-1, part.shape[-1])
        return flat.index_select(0, order).reshape(part.shape)

    aux = rows(tensor.aux) if tensor.aux is not None else None
    return QuantTensor(tensor.scheme, rows(tensor.codes), rows(tensor.scale), aux)
