"""The manifest's weight quantization of a float checkpoint (`quantization: {weights: int8}` or
`{weights: int4, group_size: N}`), as a source: the projection weights (and the LM head, and a
tied embedding table, which is the LM head) come out as `QuantTensor`s, the rest as they are.

int8: symmetric per output channel, scale = absmax / 127; int4: symmetric per group of
`group_size` inputs, scale = absmax / 7, codes clamped to [-8, 7]. Both round to nearest (half
to even) and store codes offset to unsigned (zero 128 and 8). Weights are quantized whole, before
the tp cut, so every layout widens to the same values.
"""

from __future__ import annotations

import fnmatch

import torch

from neffkit.checkpoints.quantized import QuantTensor, Source, Tensor
from neffkit.kernels.intquant import QuantScheme

TIED_TABLE = "model.embed_tokens.weight"


def manifest_scheme(spec: str) -> QuantScheme:
    """Storage.quantize ("int8", "int4:<group>") as a scheme."""
    if spec == "int8":
        return QuantScheme("sym", 8, 0, zero=128)
    kind, _, group = spec.partition(":")
    assert kind == "int4", spec
    return QuantScheme("sym", 4, int(group), zero=8)


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> QuantTensor:
    """A float [..., out, in] weight in `scheme` (symmetric; round to nearest)."""
    w = weight.float()
    cols = w.shape[-1]
    group = scheme.group_of(cols)
    grouped = w.unflatten(-1, (cols // group, group))
    qmax = (1 << (scheme.bits - 1)) - 1  # 127, 7
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(grouped / scale).clamp(-qmax - (scheme.bits == 4), qmax)
    codes = (q + scheme.zero).to(torch.uint8).flatten(-2)
    return QuantTensor(scheme, codes, scale.squeeze(-1).contiguous())


def quantizes(name: str, tied: bool) -> bool:
    """The weights the manifest's quantization reads: every projection's, the LM head's, and
    the embedding table where it is the LM head."""
    base = name.removesuffix(".weight")
    projection = name.endswith("_proj.weight") and not name.endswith("kv_b_proj.weight")
    return projection or base == "lm_head" or (tied and name == TIED_TABLE)


def excluded(name: str, patterns: tuple[str, ...], tied: bool) -> bool:
    """Does a `quantization.exclude` entry name this weight (its module name, a suffix of it,
    or a glob)? `lm_head` names a tied embedding table too."""
    base = name.removesuffix(".weight")
    aliases = {base} | ({"lm_head"} if tied and name == TIED_TABLE else set())
    return any(
        a == p or a.endswith("." + p) or fnmatch.fnmatchcase(a, p)
        for a in aliases
        for p in patterns
    )


class QuantizingSource:
    """A float source whose selected weights read quantized."""

    def __init__(self, source: Source, spec: str, exclude: tuple[str, ...], tied: bool) -> None:
        self.source, self.names = source, source.names
        self.recent: dict[str, QuantTensor] = {}  # the pipeline reads each weight per part
        self.target = manifest_scheme(spec)
        self.selected = {
            n
            for n in source.names
            if quantizes(n, tied) and not excluded(n, exclude, tied) and len(source.shape(n)) == 2
        }

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def dtype(self, name: str) -> str:
        return "Q" if name in self.selected else self.source.dtype(name)

    def scheme(self, name: str) -> QuantScheme | None:
        return self.target if name in self.selected else self.source.scheme(name)

    def read(self, name: str) -> Tensor:
        if name not in self.selected:
            return self.source.read(name)
        tensor = self.recent.get(name) or self.source.read(name)
        if name not in self.recent:
            assert isinstance(tensor, torch.Tensor)
            if len(self.recent) >= 4:
                self.recent.pop(next(iter(self.recent)))
            self.recent[name] = quantize(tensor, self.target)
        return self.recent[name]

    def close(self) -> None:
        self.source.close()
