"""A checkpoint's tensors by their HF names, whatever the file format: float tensors as they
are, quantized ones as `QuantTensor`s in neffkit's one integer layout (kernels/intquant.py).

A format (AWQ, GPTQ, compressed-tensors int, mxfp4: `formats`) maps the tensors a safetensors
checkpoint holds (`q_proj.qweight`, `.qzeros`, `.scales`) to the logical weight the family's
sharding rules ask for (`q_proj.weight`, [out, in]) and decodes them; a GGUF file is a source
of its own (checkpoints/gguf_source.py). Everything a format reads is checked against the
shapes it implies before any graph is traced: scales or zeros that do not fit their weight are
refused by name, never widened.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from neffkit.contract.tensor_files import NAMED_DTYPES, TensorReader, read_header
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme, dequantize, pack_codes


@dataclass
class QuantTensor:
    """One weight in neffkit's integer layout, codes unpacked (one uint8 per element).

    Groups run along the last dim, except with `group_dim` -2: a weight whose logical layout is
    [..., in, out] (GPT-OSS's experts in HF's layout), scale [..., in / group, out]; the
    sharding rules transpose it so that the graph weight's groups run along its last dim."""

    scheme: QuantScheme
    codes: torch.Tensor  # uint8 [..., out, in]
    scale: torch.Tensor  # float32 [..., out, in / group]
    aux: torch.Tensor | None = None  # float32 zero points or minimums, as `scale`
    group_dim: int = -1  # -1, or -2: groups along the rows (see above)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def grouped_last(self) -> QuantTensor:
        """The same weight with its groups along the last dim (transposed views for -2)."""
        if self.group_dim == -1:
            return self
        aux = self.aux.mT if self.aux is not None else None
        return QuantTensor(self.scheme, self.codes.mT, self.scale.mT, aux)

    def check(self, name: str) -> None:
        """Refuse a tensor whose parts do not fit each other (a ModelError naming it)."""
        if self.group_dim not in (-1, -2):
            raise ModelError(f"tensor {name!r}: groups along dim {self.group_dim}")
        if self.group_dim == -2:  # shapes below read transposed: [..., out, in]
            return self.grouped_last().check(name)
        shape, scheme = self.shape, self.scheme
        if (why := scheme.check_shape(shape)) is not None:
            raise ModelError(f"tensor {name!r} {list(shape)}: {why}")
        groups = (*shape[:-1], shape[-1] // scheme.group_of(shape[-1]))
        for part, tensor in (("scales", self.scale), (scheme.aux[2:] + "s", self.aux)):
            if part == "s" or tensor is None:
                continue
            if tuple(tensor.shape) != groups:
                raise ModelError(
                    f"tensor {name!r}: {part} of shape {list(tensor.shape)} do not fit its "
                    f"weight {list(shape)} at group size {scheme.group_of(shape[-1])} (expected "
                    f"{list(groups)})"
                )
        if (scheme.aux != "") != (self.aux is not None):
            raise ModelError(f"tensor {name!r}: {scheme.kind} scheme without its {scheme.aux}")
        if int(self.codes.max()) >= 1 << scheme.bits if self.codes.numel() else False:
            raise ModelError(f"tensor {name!r}: codes exceed {scheme.bits} bits")

    def expanded(self, part: str) -> torch.Tensor:
        """`scale` or `aux` one per element (float32, the shape of `codes`)."""
        tensor = self.scale if part == "scale" else self.aux
        assert tensor is not None
        group, dim = self.scheme.group_of(self.shape[self.group_dim]), self.group_dim
        return tensor.float().repeat_interleave(group, dim=dim)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values, widened exactly as the graph widens them (float twins, tests)."""
        if self.group_dim == -2:
            return self.grouped_last().dequantized(dtype).mT
        parts = {**pack_codes(self.codes, self.scheme.bits), ".qscale": self.scale}
        if self.aux is not None:
            parts[self.scheme.aux] = self.aux
        return dequantize(parts, self.scheme, dtype)


Tensor = torch.Tensor | QuantTensor


@dataclass(frozen=True)
class QuantEntry:
    """A logical quantized weight: its [..., out, in] shape, scheme and the stored tensors."""

    shape: tuple[int, ...]
    scheme: QuantScheme
    stored: tuple[str, ...]  # the checkpoint tensors it is decoded from


class Format(Protocol):
    """One checkpoint format's quantized weights over a safetensors checkpoint."""

    def entries(self, headers: dict[str, dict]) -> dict[str, QuantEntry]:
        """Logical weight name → its entry, from the headers alone (shape checks here)."""
        ...

    def decode(
        self, name: str, entry: QuantEntry, read: Callable[[str], torch.Tensor]
    ) -> QuantTensor:
        """The weight from its stored tensors (`read` by checkpoint name)."""
        ...


class Source(Protocol):
    """What the weight pipeline reads a checkpoint through (models/weights.py)."""

    names: set[str]

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> str: ...  # safetensors dtype name; "Q" for a QuantTensor

    def scheme(self, name: str) -> QuantScheme | None: ...

    def read(self, name: str) -> Tensor: ...

    def close(self) -> None: ...


def checkpoint_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (single file or index-sharded)."""
    import json

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


def base_model_names(names: Iterable[str]) -> dict[str, str]:
    """HF name → stored name where the checkpoint is a base model's (`embed_tokens.weight`, no
    name under `model.`), as vLLM's pooling adapter reads `*Model` and `*ForCausalLM` alike;
    empty where the names are HF's already."""
    names = list(names)
    if "embed_tokens.weight" not in names or any(n.startswith("model.") for n in names):
        return {}
    return {n if n.startswith("lm_head.") else f"model.{n}": n for n in names}


class SafetensorsSource:
    """An HF safetensors checkpoint, its quantized weights decoded by `fmt` (None: none)."""

    def __init__(self, model_dir: Path, fmt: Format | None = None) -> None:
        self.index = checkpoint_index(model_dir)
        self.headers: dict[str, dict] = {}
        for file in set(self.index.values()):
            self.headers.update(read_header(file))
        # a base model's checkpoint (`*Model`, as embedding models ship): its names as HF's
        # `*ForCausalLM` spells them, `model.` first, each read under its stored name
        self.stored = base_model_names(self.headers)
        if self.stored:
            self.headers = {name: self.headers[s] for name, s in self.stored.items()}
            self.index = {name: self.index[s] for name, s in self.stored.items()}
        self.fmt = fmt
        self.quantized = fmt.entries(self.headers) if fmt is not None else {}
        hidden = {s for e in self.quantized.values() for s in e.stored}
        self.names = (set(self.headers) - hidden) | set(self.quantized)
        self.readers: dict[Path, TensorReader] = {}
        self.recent: OrderedDict[str, QuantTensor] = OrderedDict()

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.quantized:
            return self.quantized[name].shape
        return tuple(self.headers[name]["shape"])

    def dtype(self, name: str) -> str:
        return "Q" if name in self.quantized else str(self.headers[name]["dtype"])

    def scheme(self, name: str) -> QuantScheme | None:
        entry = self.quantized.get(name)
        return entry.scheme if entry is not None else None

    def raw(self, name: str) -> torch.Tensor:
        """A stored tensor as the file holds it."""
        file = self.index[name]
        if file not in self.readers:
            self.readers[file] = TensorReader(file)
        return self.readers[file].get(self.stored.get(name, name))

    def read(self, name: str) -> Tensor:
        entry = self.quantized.get(name)
        if entry is None:
            return self.raw(name)
        if name in self.recent:  # the weight pipeline reads each weight once per part
            self.recent.move_to_end(name)
            return self.recent[name]
        assert self.fmt is not None
        tensor = self.fmt.decode(name, entry, self.raw)
        tensor.check(name)
        self.recent[name] = tensor
        if len(self.recent) > 8:
            self.recent.popitem(last=False)
        return tensor

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        self.recent.clear()


def meta_tensor(source: Source, name: str) -> torch.Tensor:
    """A meta tensor of the logical shape (quantized weights: their uint8 codes)."""
    dtype = source.dtype(name)
    torch_dtype = torch.uint8 if dtype == "Q" else NAMED_DTYPES.get(dtype, torch.float32)
    return torch.empty(source.shape(name), device="meta", dtype=torch_dtype)
