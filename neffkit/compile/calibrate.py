"""Per-layer K/V scales for an fp8 KV cache whose checkpoint has none, measured at build time.

An fp8 cache stores clamp(x / scale, ±448). With scale 1.0 small values fall into e4m3's
subnormals (below 2^-6 they keep 3 bits or fewer) and values past 448 are clamped. vLLM's
`calculate_kv_scales` sets each layer's scale on the first forward from the largest |K| and |V|
it sees, divided by 200 (K) and 100 (V), leaving headroom for larger values later. The build does
the same once, on a fixed calibration text (calibration.txt beside this module, tokenized by the
model's own tokenizer), running neffkit's eager model with a full-precision cache: one prefill of
the text at tp=1 (`eager_prefill`), whose cache then holds every layer's K and V. The scales,
rounded to four significant digits so a rebuild writes the same bytes, become the k_scale /
v_scale graph inputs and are recorded in bundle.json.

e4m3 keeps 3 mantissa bits whatever the scale, and a model's scores are made mostly of a few
key channels, so on a real model most of an fp8 cache's error comes from its keys. By default
(kv_cache.rotate_keys) the cache stores each key less an offset, weighted per channel and
rotated by a Hadamard matrix, queries weighted and rotated alike, and the offset's own product
with the query added back (kernels/kv.py). The same prefill measures, per layer: the mean key
before RoPE (the offset at position p is that mean put through RoPE at p: what RoPE turns with
the position no single mean after RoPE can remove), the key at position 0 (the offset there: the
attention sink, close to one vector whatever the text) and each channel's weight sqrt(|q| / |k|)
over the centered keys; the K scale is measured on the keys as the cache then stores them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from neffkit.compile.layout import model_layout
from neffkit.compile.trace import decoder_module
from neffkit.compile.units import GraphSpec, ModelLayout
from neffkit.compile.verify.inputs import representative_inputs
from neffkit.contract import abi
from neffkit.contract.abi import Phase
from neffkit.kernels.kv import key_rotation, stored_keys
from neffkit.models.forms import KEY_FORMS, Storage
from neffkit.models.key_offsets import Positional, offsets_at
from neffkit.models.parallel import Parallelism
from neffkit.models.weights import iter_rank_weights

if TYPE_CHECKING:
    from neffkit.manifest import Manifest
    from neffkit.models.step import Step

TEXT = Path(__file__).with_name("calibration.txt")
K_RANGE, V_RANGE = 200.0, 100.0  # vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT
MAX_TOKENS = 512


def calibrated(manifest: Manifest, layout: ModelLayout) -> ModelLayout:
    """The layout with its storage's K/V scales (and rotated keys' forms) measured (a layout
    that asks for none: as is)."""
    if layout.storage.kv_calibrated != ():
        return layout
    storage = dataclasses.replace(layout.storage, **kv_calibration(manifest, layout.storage))
    return dataclasses.replace(layout, storage=storage)


Values = tuple[float, ...]


def kv_calibration(manifest: Manifest, storage: Storage) -> dict[str, Any]:
    """The Storage fields one eager prefill of the calibration text measures: (k_scale,
    v_scale) per layer (`kv_calibrated`) and, where the storage rotates keys, each layer's
    `k_offsets`, `k_firsts` and `k_smooth` ([KV heads x head_dim] flat, four significant
    digits), the K scale then measured on the keys as stored."""
    cfg = manifest.model_config
    full = dataclasses.replace(
        manifest,
        parallel=Parallelism(),
        kv_cache=dataclasses.replace(manifest.kv_cache, dtype=manifest.dtype),
    )
    rotation = key_rotation(cfg.head_dim) if storage.rotate_keys else None
    forms: dict[int, tuple[torch.Tensor, ...]] = {}

    def observe(
        layer: int, q: torch.Tensor, k: torch.Tensor, positional: Positional, step: Step
    ) -> None:
        if rotation is not None:
            forms[layer] = key_forms(layer, q, k, positional, step)

    caches, _ = eager_prefill(
        model_layout(full, "cpu"), manifest.model, calibration_tokens(manifest), observe=observe
    )
    scales: list[tuple[float, float]] = []
    for layer in range(cfg.num_layers):
        # block 0 is the null block; blocks 1.. hold the text's tokens, in order
        keys = caches[f"k_cache.{layer}"][1:].float().flatten(0, 1)  # [T, KV, D]
        values = caches[f"v_cache.{layer}"][1:].float()
        if rotation is not None:
            *_, smooth, offsets = forms[layer]
            keys = stored_keys(keys, offsets, smooth, rotation)
        amax_k, amax_v = keys.abs().max().item(), values.abs().max().item()
        scales.append((_scale(amax_k, K_RANGE), _scale(amax_v, V_RANGE)))
    out: dict[str, Any] = {"kv_calibrated": tuple(scales)}  # Storage fields, for replace()
    for i, field in enumerate(KEY_FORMS.values()):  # key_forms' order
        per_layer = (_rounded(forms[layer][i]) for layer in range(cfg.num_layers))
        out[field] = tuple(per_layer) if rotation is not None else None
    return out


def key_forms(
    layer: int, q: torch.Tensor, k: torch.Tensor, positional: Positional, step: Step
) -> tuple[torch.Tensor, ...]:
    """One layer's rotated-key forms from its queries and keys before their positional
    encoding ([1, T, heads, D], positions 0..T-1): the mean key, the key at position 0, the
    channel weights [KV, D] (rounded as recorded), and the offsets at every position [T, KV, D]
    (offsets_at, as the graph builds them, from the rounded values)."""
    q_rope, k_rope = (x[0].float() for x in positional(q, k, layer, step))  # [T, heads, D]
    mean = _round(k[0].float().mean(0))
    first = _round(k_rope[0])
    offsets = offsets_at(positional, layer, step, mean, first)[0].float()  # [T, KV, D]
    tokens, kv_heads, dim = k_rope.shape
    sigma_k = (k_rope - offsets).pow(2).mean(0).sqrt().clamp(min=1e-6)  # [KV, D]
    sigma_q = q_rope.reshape(tokens, kv_heads, -1, dim).pow(2).mean((0, 2)).sqrt()
    smooth = (sigma_q.clamp(min=1e-6) / sigma_k).sqrt()
    smooth = _round(smooth / smooth.pow(2).mean(-1, keepdim=True).sqrt())  # RMS 1 per head
    return mean, first, smooth, offsets


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(_rounded(x)).reshape(x.shape)


def _rounded(x: torch.Tensor) -> Values:
    return tuple(_four_digits(v) for v in x.flatten().tolist())


def _four_digits(value: float) -> float:
    """Four significant digits, so a rebuild writes the same bytes."""
    return float(f"{value:.4g}")


def eager_prefill(
    layout: ModelLayout,
    model_dir: Path,
    ids: list[int],
    logits: bool = False,
    observe: Callable[..., None] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """One prefill of `ids` (whole KV blocks) through neffkit's eager model at tp=1, projections
    as matmuls: every layer's cache after it, by name, and (`logits`) the logits at every
    position, float32 [T, vocab] (the benchmarks' KL divergence reads them). `observe(layer, q,
    k, positional, step)` sees each layer's q and k before their positional encoding."""
    cfg, bs, tokens = layout.config, layout.block_size, len(ids)
    projection = dataclasses.replace(layout.projection, max_rows=0)
    layout = dataclasses.replace(layout, num_blocks=tokens // bs + 1, kv_groups=())  # whole caches
    layout = dataclasses.replace(layout, prompt_logprobs=logits, projection=projection)
    spec = GraphSpec("prefill", Phase.PREFILL, 1, tokens, tokens)
    module, specs = decoder_module(layout, spec)
    weights = [t for _, t in iter_rank_weights(model_dir, cfg, layout.storage, layout.par, 0)]
    inputs = representative_inputs(layout, spec, weights)
    index = {s.name: i for i, s in enumerate(specs)}
    positions = torch.arange(tokens).reshape(1, tokens)
    overrides = {
        abi.INPUT_IDS: torch.tensor([ids]),
        abi.POSITIONS: positions,
        abi.SLOT_MAPPING: positions + bs,  # blocks 1.. in order (block 0 is the null block)
        abi.BLOCK_TABLES: torch.arange(1, tokens // bs + 1).reshape(1, -1),
        abi.CONTEXT_LENS: torch.tensor([tokens]),
        abi.LAST_TOKEN_INDEX: torch.tensor([tokens - 1]),
    }
    for name, value in overrides.items():
        inputs[index[name]] = value.to(inputs[index[name]].dtype)
    names = abi.kv_cache_names(cfg.num_layers, cfg.kv_kind)
    for name in names:
        inputs[index[name]] = torch.zeros_like(inputs[index[name]])
    if observe is not None:
        positional = module.positional

        def observed(
            q: torch.Tensor, k: torch.Tensor, layer: int, step: Step
        ) -> tuple[torch.Tensor, torch.Tensor]:
            observe(layer, q, k, positional, step)
            return positional(q, k, layer, step)

        # this instance's methods wrapped to watch them (mypy refuses assigning to a method)
        module.positional = observed  # type: ignore[method-assign]
    seen: list[torch.Tensor] = []
    logits_of = module.logits

    def watched(x: torch.Tensor, head: torch.Tensor, rank: torch.Tensor | None) -> torch.Tensor:
        seen.append(logits_of(x, head, rank))  # the full [T, vocab]
        return seen[-1]

    module.logits = watched  # type: ignore[method-assign]  # wrapped, as positional above
    with torch.no_grad():
        module(*inputs)  # writes every layer's K and V into the caches, in place
    caches = {name: inputs[index[name]] for name in names}
    return caches, seen[0].float() if logits else None


def _scale(amax: float, value_range: float) -> float:
    return _four_digits(max(amax, 1e-6) / value_range)


def calibration_tokens(manifest: Manifest) -> list[int]:
    """The ids one prefill calibrates on: the text's, whole KV blocks of them."""
    ids = calibration_ids(manifest.model, manifest.model_config.vocab_size)
    bs = manifest.kv_cache.block_size
    tokens = max(bs, len(ids) // bs * bs)
    return (ids * (tokens // len(ids) + 1))[:tokens]


def calibration_ids(model_dir: Path, vocab: int) -> list[int]:
    """The calibration text in the model's tokens (its tokenizer.json); without a tokenizer,
    fixed pseudo-random ids (a random checkpoint has no text of its own)."""
    tokenizer = Path(model_dir) / "tokenizer.json"
    if tokenizer.exists():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tokenizer)).encode(TEXT.read_text()).ids
        return [i for i in ids if i < vocab][:MAX_TOKENS]
    rng = random.Random(0)
    return [rng.randrange(vocab) for _ in range(256)]
