"""A checkpoint → each rank's ordered weight list (the graphs' weight inputs).

Tensors are read one at a time into their own buffers (never the whole checkpoint at once), cut
for the rank by `sharding.rank_weights` and cast to the bundle dtype. Shapes alone come from the
safetensors headers through meta tensors, with the same cutting code. Order is fixed by
`rank_weights` and recorded in bundle.json; graphs and the runtime both follow it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from neffkit.checkpoints.int_cuts import (
    QuantParts,
    SchemeTags,
    codes_getter,
    meta_getter,
    stored_parts,
    stored_specs,
)
from neffkit.checkpoints.quantized import checkpoint_index
from neffkit.checkpoints.sources import Checkpoint, open_source
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme
from neffkit.kernels.kv import key_rotation
from neffkit.kernels.quant import (
    effective_block,
    expand_scales,
    lane_scales,
    quantize_blocks,
    scale_grid,
)
from neffkit.models.config import ModelConfig
from neffkit.models.forms import (
    KEY_FORMS,
    TIED_TABLE,
    Storage,
    blocked_shape,
    blocks,
    takes_projection_form,
)
from neffkit.models.parallel import Parallelism
from neffkit.models.projection import to_blocked
from neffkit.models.registry import shards_class
from neffkit.models.shards import FP8_SCALE, K_ROTATION, Named, keeps_float32, kv_scale_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _storage(storage: Storage | str) -> Storage:
    return storage if isinstance(storage, Storage) else Storage(storage)


def rank_weights(
    cfg: ModelConfig,
    par: Parallelism,
    rank: int,
    get: Callable[[str], torch.Tensor],
    available: set[str],
    kv_scales: bool = False,
) -> Named:
    """(name, tensor) for one rank, in graph order, cut by the family's sharding rules."""
    return iter(shards_class(cfg)(cfg, par, rank, get, available, kv_scales))


def has_kv_scales(model_dir: Path) -> bool:
    """Does the checkpoint carry per-layer KV cache scales (compressed-tensors, ModelOpt)?
    (Layer 0's K scale, under either name `shards.kv_scale_name` reads.)"""
    from neffkit.checkpoints.gguf_dir import POINTER

    if (model_dir / POINTER).is_file():  # a GGUF file's tensors (gguf_dir.py): no KV scales
        return False
    names = set(checkpoint_index(model_dir))
    return kv_scale_name("model.layers.0", "k", names) in names


def calibrated_tensors(cfg: ModelConfig, storage: Storage) -> dict[str, torch.Tensor]:
    """What a build calibrated for an fp8 KV cache (compile/calibrate.py), under the names the
    shards read: each layer's k_scale and v_scale, with rotated keys the rotation and each
    layer's k_offset, k_first and k_smooth (all KV heads; the shards cut a rank's); meta while
    the layout is planned (shapes only)."""
    if storage.kv_calibrated is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    pairs = storage.kv_calibrated or ((None, None),) * cfg.num_layers
    for layer, pair in enumerate(pairs):
        p = f"model.layers.{layer}.self_attn"
        for kind, value in zip("kv", pair, strict=True):
            out[f"{p}.{kind}_scale"] = _values(value, (1,))
    if not storage.rotate_keys:
        return out
    heads = (cfg.num_kv_heads, cfg.head_dim)
    for name, per_layer in KEY_FORMS.items():
        values = getattr(storage, per_layer) or (None,) * cfg.num_layers
        for layer, value in enumerate(values):
            out[f"model.layers.{layer}.self_attn.{name}"] = _values(value, heads)
    out[K_ROTATION] = key_rotation(cfg.head_dim)
    return out


def _values(values: float | tuple[float, ...] | None, shape: tuple[int, ...]) -> torch.Tensor:
    if values is None:
        return torch.empty(shape, device="meta")
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


def weight_dtype(name: str, dtype: str) -> torch.dtype:
    """The bundle dtype, except for tensors that stay float32 (rope frequencies)."""
    return torch.float32 if keeps_float32(name) else DTYPES[dtype]


FP8 = torch.float8_e4m3fn
SCALE = FP8_SCALE  # the graph input beside each fp8 weight: one float32 per block
HEAD = "lm_head.weight"


def rank_weight_specs(
    model_dir: Path, cfg: ModelConfig, storage: Storage | str, par: Parallelism, rank: int
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, bundle dtype) of one rank's weights, in graph order, from headers only:
    tracing never needs values. An fp8 weight keeps float8_e4m3fn and is followed by its
    float32 block scales (`<name>.scale`); stored blocked, its scales are `lane_scales`. An
    integer one is its packed codes and their group parts (checkpoints/int_cuts.py)."""
    return _specs_and_schemes(model_dir, cfg, _storage(storage), par, rank)[0]


def rank_weight_plan(
    model_dir: Path, cfg: ModelConfig, storage: Storage | str, par: Parallelism, rank: int
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[str, QuantScheme]]:
    """`rank_weight_specs`, and each quantized graph weight's scheme after the rank's cut
    (what graphs are traced from: ModelConfig.weight_quant)."""
    return _specs_and_schemes(model_dir, cfg, _storage(storage), par, rank)


def _specs_and_schemes(
    model_dir: Path, cfg: ModelConfig, storage: Storage, par: Parallelism, rank: int
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[str, QuantScheme]]:
    calibrated = calibrated_tensors(cfg, storage)
    source = Checkpoint(open_source(model_dir, cfg, storage), cfg, calibrated)
    meta = meta_getter(source)

    def run(get: Callable[[str], torch.Tensor]) -> Named:
        return rank_weights(cfg, par, rank, get, source.names, storage.kv_scales)

    tags = SchemeTags()
    parts = QuantParts(source, run, tags, values=False) if source.quantized else None
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    schemes: dict[str, QuantScheme] = {}
    try:
        named = ((n, t, None) for n, t in run(meta))
        for name, t, _ in _with_fp8_head(named, cfg, storage):
            scheme = tags.of(name, parts.next()[0]) if parts is not None else None
            scheme = stored_scheme(name, scheme, storage)
            if scheme is not None:
                schemes[name] = scheme
                out.extend(stored_specs(name, tuple(t.shape), scheme))
            elif t.dtype == FP8:
                shape = tuple(t.shape)
                grid = scale_grid(shape, cfg.fp8_block)
                if blocks(name, shape, storage.fp8_lanes):  # scales as lane_scales
                    grid = (shape[0] // storage.fp8_lanes, grid[-1], storage.fp8_lanes)
                    shape = blocked_shape(shape, storage.fp8_lanes)
                out.append((name, shape, FP8))
                out.append((name + SCALE, grid, torch.float32))
            else:
                shape = tuple(t.shape)
                if blocks(name, shape, storage.lanes, storage.table_is_head(cfg.head_is_table)):
                    shape = blocked_shape(shape, storage.lanes)
                out.append((name, shape, weight_dtype(name, storage.dtype)))
    finally:
        source.close()
    return out, schemes


def stored_scheme(name: str, scheme: QuantScheme | None, storage: Storage) -> QuantScheme | None:
    """The scheme a graph weight is stored in: its own, or for 5- and 6-bit projection codes in
    groups of a multiple of 32 under `Storage.byte_codes`, the same values one code a byte."""
    if scheme is None or not storage.byte_codes or scheme.bits not in (5, 6):
        return scheme
    if scheme.kind == "e2m1" or scheme.group % 32 or not takes_projection_form(name):
        return scheme
    return dataclasses.replace(scheme, bits=8)


def rank_weight_shapes(
    model_dir: Path, cfg: ModelConfig, par: Parallelism, rank: int
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of one rank's weights (fp8 block scales included), from headers only."""
    return [(n, s) for n, s, _ in rank_weight_specs(model_dir, cfg, Storage("float32"), par, rank)]


def iter_rank_weights(
    model_dir: Path, cfg: ModelConfig, storage: Storage | str, par: Parallelism, rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield one rank's (name, tensor) in graph order, read one at a time, cut, cast, compact.

    Each tensor is read into its own buffer (tensor_files.TensorReader, not an mmap), so memory
    holds one tensor and its cast at a time, whatever the checkpoint's size. fp8 weights stay
    fp8: their block scales are cut by the same sharding code, run a second time on the scales
    expanded to one per element, then taken back to one per block; a cut that splits a block
    cannot be taken back, and is an error naming the tensor."""
    storage = _storage(storage)
    source = Checkpoint(open_source(model_dir, cfg, storage), cfg, calibrated_tensors(cfg, storage))

    def run(get: Callable[[str], torch.Tensor]) -> Named:
        return rank_weights(cfg, par, rank, get, source.names, storage.kv_scales)

    scales = run(source.expanded_scale) if cfg.fp8_block else None
    tags = SchemeTags()
    parts = QuantParts(source, run, tags, values=True) if source.quantized else None
    tied = storage.table_is_head(cfg.head_is_table)
    named = (
        (name, tensor, next(scales)[1] if scales is not None else None)
        for name, tensor in run(codes_getter(source))
    )
    try:
        for name, tensor, scale in _with_fp8_head(named, cfg, storage):
            if parts is not None:
                element_tags, element_scale, aux = parts.next()
                scheme = stored_scheme(name, tags.of(name, element_tags), storage)
                if scheme is not None:
                    yield from stored_parts(name, scheme, tensor, element_scale, aux)
                    continue
            if tensor.dtype == FP8:
                assert scale is not None
                tensor, block_scale = _fp8_stored(name, tensor, scale, cfg.fp8_block, storage)
                yield name, _compact(tensor)
                yield name + SCALE, _compact(block_scale)
                continue
            cast = tensor.to(weight_dtype(name, storage.dtype))
            if blocks(name, tuple(cast.shape), storage.lanes, tied):
                cast = to_blocked(cast, storage.lanes)
            yield name, _compact(cast)
            del tensor, cast
    finally:
        source.close()


def _with_fp8_head(
    named: Iterator[tuple[str, torch.Tensor, torch.Tensor | None]],
    cfg: ModelConfig,
    storage: Storage,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, tensor, per-element fp8 scale or None), with the LM head quantized to fp8 by the
    checkpoint's scale blocks where the manifest asks (Storage.fp8_head): an untied head in its
    place, a tied one as `lm_head.weight` right after the rank's embedding rows it copies.
    Quantized after the vocabulary cut, so a rank's share starts its own blocks. A head the
    checkpoint ships in fp8 already is read with its own scales, not quantized again."""
    for name, tensor, scale in named:
        head = storage.fp8_head and name == HEAD and tensor.dtype != FP8
        if not head:
            yield name, tensor, scale
        if head or (storage.fp8_head and cfg.tie_word_embeddings and name == TIED_TABLE):
            q, grid = quantize_blocks(tensor, cfg.fp8_block)
            yield HEAD, q, expand_scales(grid, tuple(q.shape), cfg.fp8_block)


def _fp8_stored(
    name: str, tensor: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], storage: Storage
) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 weight and its scales as the bundle stores them: one scale per block, the values
    within the target's fp8 range, blocked (scales as `lane_scales`) where the kernel may read
    them (Storage.fp8_lanes)."""
    block_scale = _per_block(name, scale, block)
    rescale = storage.fp8_rescale
    if rescale != 1.0:  # into ±240: the weight scaled down, its scale up
        tensor, block_scale = (tensor.float() * rescale).to(FP8), block_scale / rescale
    if blocks(name, tuple(tensor.shape), storage.fp8_lanes):
        block_scale = lane_scales(block_scale, tuple(tensor.shape), block, storage.fp8_lanes)
        tensor = to_blocked(tensor, storage.fp8_lanes)
    return tensor, block_scale


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A compact tensor: a slice must not drag its parent's storage into the file."""
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _per_block(name: str, expanded: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """One scale per block of the rank's share again; the cut must have kept every block whole
    (per-channel and per-tensor scales survive any cut)."""
    b = effective_block(tuple(expanded.shape), block)
    compact = expanded[..., :: b[0], :: b[1]].contiguous()
    if not torch.equal(expand_scales(compact, list(expanded.shape), block), expanded):
        raise ModelError(
            f"tensor {name!r}: the parallel layout cuts it inside a {b[0]}x{b[1]} fp8 "
            "block, so a rank's share spans blocks its own block grid cannot scale (a rank's "
            "share of each dimension should start on a block boundary)",
            field="parallel.tp",
        )
    return compact


def load_weights(
    model_dir: Path, cfg: ModelConfig, storage: Storage | str
) -> dict[str, torch.Tensor]:
    """All weights for tp=1 (tests and tools)."""
    return dict(iter_rank_weights(model_dir, cfg, storage, Parallelism(), 0))
