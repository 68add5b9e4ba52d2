"""Integer and fp4 weights through the sharding rules, kept at their width.

A family's sharding rules slice, stack, concatenate and transpose tensors by name; they know
nothing of packed codes or group scales. So, as for fp8 scales (weights.py), they run once per
part on tensors with one value per element: the codes (uint8), each element's scale, its zero
point or minimum, and a tag naming its scheme. What comes out is regrouped along the graph
weight's last dimension (its inputs) and packed again (kernels/intquant.py). A cut inside a
group, or a graph weight made of two schemes, cannot be regrouped, and is refused naming the
tensor; padding a vocabulary shard adds zero codes and scales (tag 0: any scheme), which widen
to zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from neffkit.checkpoints.quantized import QuantTensor, Source, meta_tensor
from neffkit.errors import ModelError
from neffkit.kernels.intquant import SCALE, QuantScheme, pack_codes

Getter = Callable[[str], torch.Tensor]
Run = Callable[[Getter], Iterator[tuple[str, torch.Tensor]]]


class SchemeTags:
    """Each scheme a source uses, numbered from 1 (0 marks padding)."""

    def __init__(self) -> None:
        self.ids: dict[QuantScheme, int] = {}
        self.schemes: dict[int, QuantScheme] = {}

    def tag(self, scheme: QuantScheme) -> int:
        if scheme not in self.ids:
            self.ids[scheme] = len(self.ids) + 1
            self.schemes[self.ids[scheme]] = scheme
        return self.ids[scheme]

    def tensor(self, source: Source, name: str) -> torch.Tensor:
        """The scheme tag of every element (a broadcast view: no memory until a stack)."""
        shape = source.shape(name)
        scheme = source.scheme(name)
        if scheme is None:
            return torch.empty(shape, device="meta", dtype=torch.uint8)
        one = torch.full((1,) * len(shape), self.tag(scheme), dtype=torch.uint8)
        return one.expand(shape)

    def of(self, name: str, tags: torch.Tensor) -> QuantScheme | None:
        """The one scheme of a graph weight's elements (None: a float tensor)."""
        if tags.is_meta or tags.dtype != torch.uint8:  # float, or computed by the rules (rope)
            return None
        if tags.numel() and all(s == 0 for s in tags.stride()):  # one broadcast tag
            return self.schemes[int(tags.reshape(-1)[0])]
        # two reductions, not a sort: the tags are one byte per element of the weight
        high = int(tags.amax()) if tags.numel() else 0
        low = int(torch.where(tags > 0, tags, high).amin()) if high else 0
        if high == 0 or low != high:
            names = sorted(self.schemes[t].to_id() for t in {low, high} if t)
            raise ModelError(f"tensor {name!r} joins weights of different quantizations {names}")
        return self.schemes[high]


class QuantParts:
    """The per-element scales, zero points / minimums and scheme tags of one rank's weights,
    cut by the same rules as the codes (`run` runs the family's rules with a getter)."""

    def __init__(self, source: Source, run: Run, tags: SchemeTags, values: bool) -> None:
        self.source, self.tags = source, tags
        self.tag_iter = run(lambda n: tags.tensor(source, n))
        self.scale_iter = run(lambda n: self._element(n, "scale")) if values else None
        self.aux_iter = run(lambda n: self._element(n, "aux")) if values else None

    def _element(self, name: str, part: str) -> torch.Tensor:
        scheme = self.source.scheme(name)
        if scheme is None or (part == "aux" and not scheme.aux):
            return torch.empty(self.source.shape(name), device="meta")
        tensor = self.source.read(name)
        assert isinstance(tensor, QuantTensor)
        return tensor.expanded(part)

    def next(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tags, scales, aux) of the next graph weight."""
        tags = next(self.tag_iter)[1]
        if self.scale_iter is None or self.aux_iter is None:
            return tags, None, None
        return tags, next(self.scale_iter)[1], next(self.aux_iter)[1]


def codes_getter(source: Source) -> Getter:
    """The codes of a quantized weight (one uint8 per element), other tensors as they are."""

    def get(name: str) -> torch.Tensor:
        tensor = source.read(name)
        return tensor.codes if isinstance(tensor, QuantTensor) else tensor

    return get


def meta_getter(source: Source) -> Getter:
    return lambda name: meta_tensor(source, name)


def stored_specs(
    name: str, shape: tuple[int, ...], scheme: QuantScheme
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of what the bundle stores for a graph weight of `shape`."""
    if (why := scheme.check_shape(shape)) is not None:
        raise ModelError(
            f"tensor {name!r} {list(shape)}: after the parallel cut, {why}", field="parallel.tp"
        )
    return [(name + suffix, s, dtype) for suffix, (s, dtype) in scheme.stored(shape).items()]


def stored_parts(
    name: str,
    scheme: QuantScheme,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    aux: torch.Tensor | None,
) -> list[tuple[str, torch.Tensor]]:
    """What the bundle stores for one graph weight: codes packed, scales and zero points or
    minimums one per group again (`stored_specs` names and orders them)."""
    shape = tuple(codes.shape)
    specs = stored_specs(name, shape, scheme)
    assert scale is not None
    group = scheme.group_of(shape[-1])
    parts = {f"{name}{k}": v for k, v in pack_codes(codes, scheme.bits).items()}
    parts[name + SCALE] = _per_group(name, scale, group)
    if scheme.aux:
        assert aux is not None
        parts[name + scheme.aux] = _per_group(name, aux, group)
    return [(n, parts[n].contiguous()) for n, _, _ in specs]


def _per_group(name: str, expanded: torch.Tensor, group: int) -> torch.Tensor:
    """One value per group of the rank's share again; every group must have stayed whole."""
    compact = expanded[..., ::group].contiguous()
    if not torch.equal(compact.repeat_interleave(group, dim=-1), expanded):
        raise ModelError(
            f"tensor {name!r}: the parallel layout cuts it inside a quantization group of "
            f"{group}, so a rank's share does not start on a group boundary",
            field="parallel.tp",
        )
    return compact
