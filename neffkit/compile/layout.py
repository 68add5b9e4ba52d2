"""Manifest → ModelLayout: what every graph of a build is traced from, from safetensors headers
alone (tracing never needs weight values), and each graph's flat input specs (the graph ABI).

Every rank's shard has the same names and shapes (that is what makes SPMD possible); this is
checked here, before any tracing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from neffkit.compile.adapters import lora_record
from neffkit.compile.backends import get_backend
from neffkit.compile.backends.base import Backend
from neffkit.compile.units import GraphSpec, ModelLayout
from neffkit.contract import abi
from neffkit.contract.abi import GraphShape, TensorSpec
from neffkit.contract.kv_groups import KVGroup, layer_groups, plan_groups, size_groups
from neffkit.errors import BuildError, ManifestError
from neffkit.kernels.int8_blocks import blocks_kernel_scheme
from neffkit.kernels.intquant import QuantScheme
from neffkit.manifest.schema import Sampling
from neffkit.manifest.sections import kv_bytes_per_token
from neffkit.models.forms import (
    KEY_FORMS,
    PLAIN,
    ProjectionPolicy,
    Storage,
    packs_to_kernel,
    takes_projection_form,
)
from neffkit.models.registry import takes_hidden
from neffkit.models.weights import has_kv_scales, rank_weight_plan, rank_weight_specs
from neffkit.targets import DTYPE_BYTES, E4M3FN_MAX

if TYPE_CHECKING:
    from neffkit.manifest import Manifest


def weight_storage(manifest: Manifest, lanes: int = 0) -> Storage:
    """How this manifest's bundle stores the checkpoint: dtype, the trn1/trn2 fp8 rescale
    (values into ±240), whether the fp8 KV cache reads k/v scales (the checkpoint's, or ones the
    build calibrates), and the projection weights' blocked layout (ProjectionPolicy.lanes)."""
    from_checkpoint = manifest.fp8_kv_cache and has_kv_scales(manifest.model)
    calibrate = manifest.fp8_kv_cache and not from_checkpoint and manifest.kv_cache.calibrate
    if from_checkpoint and manifest.kv_cache.rotate_keys:
        raise ManifestError(
            "kv_cache.rotate_keys: the checkpoint's k_scale / v_scale are for keys as they are",
            hint="leave kv_cache.rotate_keys out: rotated keys need scales the build measures",
        )
    rotate = calibrate and manifest.kv_cache.rotate_keys is not False
    planned = () if rotate else None  # measured with the scales (compile/calibrate.py)
    return Storage(
        manifest.dtype,
        fp8_rescale=manifest.fp8_max / E4M3FN_MAX if manifest.model_config.fp8_block else 1.0,
        kv_scales=from_checkpoint or calibrate,
        kv_calibrated=() if calibrate else None,  # measured before the weights are written
        rotate_keys=rotate,
        **dict.fromkeys(KEY_FORMS.values(), planned),
        lanes=lanes,
        fp8_head=manifest.lm_head_dtype == "float8_e4m3fn",
        quantize=manifest.quantization.storage if manifest.quantization else "",
        quantize_exclude=manifest.quantization.exclude if manifest.quantization else (),
    )


def model_layout(
    manifest: Manifest, device: str, projection: ProjectionPolicy = PLAIN
) -> ModelLayout:
    """The layout of every rank's graphs (rank 0's weight specs; the others must equal them)."""
    cfg, par = manifest.model_config, manifest.parallel
    storage = weight_storage(manifest, projection.lanes)
    if _kernel_reads_fp8(manifest, projection, storage):
        storage = dataclasses.replace(storage, fp8_lanes=projection.lanes)
    if projection.kernel != "off" and projection.max_rows:  # the kernels read 4- and 8-bit codes
        storage = dataclasses.replace(storage, byte_codes=True)
    specs, schemes = rank_weight_plan(manifest.model, cfg, storage, par, 0)
    if manifest.quantization and manifest.quantization.activations:
        schemes = int8_activation_schemes(schemes, manifest.model)
    if schemes:  # the graphs widen each integer weight by its scheme
        quant = tuple(sorted((name, s.to_id()) for name, s in schemes.items()))
        cfg = dataclasses.replace(cfg, weight_quant=quant)
    for rank in range(1, par.tp):
        if rank_weight_specs(manifest.model, cfg, storage, par, rank) != specs:
            raise BuildError(f"rank {rank}'s weight shards differ from rank 0's in name or shape")
    options = {"mla_decode": manifest.mla_decode} if cfg.kv_kind == "mla" else {}
    spec, sampling = manifest.speculation, manifest.sampling
    is_mtp = takes_hidden(cfg)  # the MTP layer's own graphs
    hidden = cfg.hidden_size if is_mtp or (spec is not None and spec.method == "mtp") else 0
    embed = manifest.embedding
    if embed is not None:  # the graphs return pooled states and sample nothing
        hidden = cfg.hidden_size
        sampling = Sampling(structured=False, max_penalty_tokens=0, max_logit_bias=0)
    groups = kv_groups(manifest)
    return ModelLayout(
        config=cfg,
        dtype=manifest.dtype,
        kv_heads=cfg.kv_heads_per_rank(par),
        weights=tuple(
            TensorSpec(name, shape, str(dtype).removeprefix("torch."))
            for name, shape, dtype in specs
        ),
        block_size=manifest.kv_cache.block_size,
        num_blocks=groups[0].num_blocks if groups else manifest.kv_cache.num_blocks,
        kv_groups=groups,
        max_top_k=sampling.max_top_k,
        max_logprobs=sampling.max_logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
        device=device,
        par=par,
        projection=projection,
        graph_options=tuple(sorted(options.items())),
        kv_dtype=manifest.kv_cache.dtype,
        fp8_max=manifest.fp8_max,
        storage=storage,
        decode_state=manifest.decode_state,
        hidden_out=hidden,
        hidden_in=cfg.hidden_size if is_mtp else 0,
        bitmask_words=-(-cfg.vocab_size // 32) if sampling.structured else 0,
        penalty_tokens=sampling.penalty_tokens(manifest.buckets.context[-1], cfg.vocab_size),
        bias_tokens=sampling.max_logit_bias,
        lora=lora_record(manifest.lora, cfg, manifest.dtype, par) if manifest.lora else None,
        pooling=embed.pooling if embed is not None else "",
    )


def kv_groups(manifest: Manifest) -> tuple[KVGroup, ...]:
    """The KV groups (contract/kv_groups.py): none where every layer keeps every position.
    A sliding group's sequence holds the window behind the longest step: the largest prefill
    bucket, or a block plus a verify step's drafts."""
    cfg, kv, buckets = manifest.model_config, manifest.kv_cache, manifest.buckets
    spec, bs, context = manifest.speculation, kv.block_size, buckets.context[-1]
    chunk = max(buckets.prefill[-1], bs + (spec.num_tokens if spec is not None else 0))
    plan = plan_groups(cfg.sliding_windows, bs, context, chunk)
    if not kv.hybrid or (len(plan) == 1 and plan[0][0] is None):
        return ()
    if spec is not None and spec.method == "draft":
        raise ManifestError(
            "speculation.method draft: a draft model over sliding-window KV groups is not "
            "supported (the draft's cache follows the target's one block table)",
            hint="use speculation.method ngram",
        )
    budget = None
    if kv.memory_mb is not None:  # layer-blocks the budget holds, split by need
        per_layer = kv_bytes_per_token(cfg, manifest.parallel, kv.dtype) // cfg.num_layers
        budget = kv.memory_mb * 2**20 // (bs * per_layer)
    return size_groups(plan, kv.num_blocks, context // bs, budget)


def _kernel_reads_fp8(manifest: Manifest, policy: ProjectionPolicy, storage: Storage) -> bool:
    """Store fp8 projections blocked for the kernel? With `on`, or with `auto` where some
    projection is large enough for the build to time the kernel against Inductor's forms
    (compile/autotune.py): Inductor reads a plain fp8 weight far faster than a blocked one."""
    if not manifest.model_config.fp8_block or policy.kernel == "off" or policy.max_rows == 0:
        return False
    if policy.kernel == "on":
        return True
    specs = rank_weight_specs(manifest.model, manifest.model_config, storage, manifest.parallel, 0)
    return any(
        math.prod(shape) * dtype.itemsize >= policy.kernel_min_bytes
        for name, shape, dtype in specs
        if takes_projection_form(name)
    )


def graph_shape(layout: ModelLayout, spec: GraphSpec) -> GraphShape:
    return GraphShape(
        phase=spec.phase,
        rows=spec.rows,
        tokens=spec.tokens,
        context=spec.context,
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        logprobs=layout.max_logprobs,
        # a prompt wanting them prefills alone
        prompt_logprobs=layout.prompt_logprobs and spec.rows == 1,
        device_state=layout.decode_state == "device",
        hidden_out=layout.hidden_out,
        hidden_in=layout.hidden_in,
        bitmask_words=layout.bitmask_words,
        penalty_tokens=layout.penalty_tokens,
        bias_tokens=layout.bias_tokens,
        adapters=layout.lora is not None,
        group_blocks=tuple(g.num_blocks for g in layout.kv_groups),
        layer_group=layer_groups(layout.kv_groups, layout.config.num_layers)
        if layout.kv_groups
        else (),
        pooling=layout.pooling,
    )


def graph_inputs(layout: ModelLayout, spec: GraphSpec) -> tuple[GraphShape, list[TensorSpec]]:
    """A graph's shape and its flat inputs in ABI order: metadata, rank, caches, state, adapter
    slots, weights."""
    cfg = layout.config
    shape = graph_shape(layout, spec)
    specs = abi.metadata_inputs(shape)
    if cfg.needs_rank_input(layout.par):
        specs.append(TensorSpec(abi.RANK, (1,), "int64"))
    specs += abi.kv_inputs(
        shape, cfg.num_layers, cfg.kv_kind, layout.kv_heads, cfg.kv_width, layout.kv_dtype
    )
    specs += abi.state_inputs(shape)
    return shape, specs + adapter_inputs(layout) + list(layout.weights)


def adapter_inputs(layout: ModelLayout) -> list[TensorSpec]:
    """The adapter slot tensors (contract/lora.py), before the weights; none without `lora:`."""
    if layout.lora is None:
        return []
    return [TensorSpec(*spec) for spec in layout.lora.input_specs(layout.par.tp)]


def blocked_projections(layout: ModelLayout) -> list[TensorSpec]:
    """The projection weights stored blocked (each one's form is picked per graph)."""
    return [w for w in layout.weights if len(w.shape) == 3 and takes_projection_form(w.name)]


def spec_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * DTYPE_BYTES[spec.dtype]


def blocked_weight_bytes(layout: ModelLayout) -> list[int]:
    """The bytes of each projection weight stored blocked (what picks its form), largest first."""
    return sorted((spec_bytes(w) for w in blocked_projections(layout)), reverse=True)


def _projection_schemes(layout: ModelLayout) -> dict[str, tuple[QuantScheme, int]]:
    """The quantized weights that take a projection form, by name: their schemes and inputs."""
    cols = {w.name: w.shape[-1] for w in layout.weights}
    out = {}
    for name, scheme_id in layout.config.weight_quant:
        if takes_projection_form(name):
            scheme = QuantScheme.from_id(scheme_id)
            # 4 to 6 bits: nibbles, two a byte
            out[name] = scheme, cols[name] * (1 if scheme.bits == 8 else 2)
    return out


def packed_kernel_weights(layout: ModelLayout) -> list[str]:
    """Quantized projection weights neffkit::packed_rows reads at decode rows (forms.
    packs_to_kernel; float32 compute): weight-only, or int8-block weights where
    neffkit::int8_blocks does not read them (their quantized rows)."""
    if layout.dtype != "float32":
        return []
    return [
        name
        for name, (scheme, cols) in _projection_schemes(layout).items()
        if packs_to_kernel(scheme.bits, scheme.group, cols, scheme.activations != "int8-token")
    ]


def block_kernel_weights(layout: ModelLayout) -> list[str]:
    """int8-block projection weights neffkit::int8_blocks reads (`blocks_kernel_scheme`)."""
    schemes = _projection_schemes(layout)
    return [name for name, (s, cols) in schemes.items() if blocks_kernel_scheme(s, cols)]


def uses_kernel(layout: ModelLayout) -> bool:
    """Do this layout's graphs call neffkit's CPU kernels (decode attention, or some blocked
    weight taking the kernel form at some row count: every decode row count, and the larger
    ones the build measured)?"""
    policy = layout.projection
    if policy.attention_kernel or (policy.lora_kernel and layout.lora is not None):
        return True
    if policy.kernel == "off" or policy.max_rows == 0:
        return False
    if packed_kernel_weights(layout) and policy.packed_form(1, True) == "kernel-packed":
        return True
    int8 = has_w8a8(layout) or block_kernel_weights(layout)
    if int8 and policy.int8_form(1) == "kernel-int8":
        return True
    sizes = blocked_weight_bytes(layout)
    rows = {*range(1, policy.max_rows + 1), *(policy.kernel_rows or ())}
    return any(policy.form(r, True, size) == "kernel-rows" for size in sizes for r in rows)


def target_layout(manifest: Manifest, backend: Backend | None = None) -> ModelLayout:
    """The shapes every graph of this manifest is traced from, as its target traces them."""
    backend = backend or get_backend(manifest.target)
    return model_layout(manifest, backend.device, projection_policy(manifest, backend))


def projection_policy(manifest: Manifest, backend: Backend) -> ProjectionPolicy:
    """The backend's projection forms, with the cpu kernel as the manifest and host allow
    (`compiler.cpu_kernel: on` on a host below AVX2 is an error; `auto` goes without)."""
    policy = backend.projection
    mode = manifest.compiler.cpu_kernel
    if backend.name != "cpu" or policy.lanes == 0 or mode == "off":
        return policy
    from neffkit.platform import cpu_kernels, isa

    if not cpu_kernels.supported():
        if mode == "on":
            raise BuildError(
                "compiler.cpu_kernel: on needs a CPU class the kernels are written for "
                f"({', '.join(cpu_kernels.KERNEL_CLASSES)}); this build's is "
                f"{isa.chosen_class() or 'below avx2'}",
                hint="use cpu_kernel: auto (or off)",
            )
        return policy
    # the kernel reads float32 and bf16 caches of the compute dtype, not fp8 or MLA's latents
    attention = manifest.dtype in ("float32", "bfloat16") and not manifest.fp8_kv_cache
    attention = attention and manifest.model_config.kv_kind != "mla"
    # bf16 on the AVX2 class: no bf16 GEMM but ATen's scalar loop, so every attention reads
    # through the kernel (`ProjectionPolicy.prefill_attention_kernel`)
    scalar_bf16 = attention and manifest.dtype == "bfloat16" and isa.chosen_class() == "avx2"
    return dataclasses.replace(
        policy,
        kernel=mode,
        attention_kernel=attention,
        prefill_attention_kernel=scalar_bf16,
        lora_kernel=manifest.lora is not None,
    )


def projection_form(layout: ModelLayout, rows: int) -> str:
    """How a graph of `rows` activation rows writes the layers' projections (recorded; forms
    that differ by weight size are joined with "+", the largest weights' form first; weights
    kept at their storage width last, as `packed_form` writes them; the integer kernel's form
    after those for W8A8 and int8-block weights, their graph forms not named: the float or
    packed forms')."""
    policy = layout.projection
    forms = dict.fromkeys(policy.form(rows, True, size) for size in blocked_weight_bytes(layout))
    schemes = _projection_schemes(layout)
    in_kernel = policy.int8_form(rows) == "kernel-int8"
    blocks = set(block_kernel_weights(layout)) if in_kernel else set()
    if any(s.activations != "int8-token" and n not in blocks for n, (s, _) in schemes.items()):
        forms[policy.packed_form(rows, bool(packed_kernel_weights(layout)))] = None
    if in_kernel and (has_w8a8(layout) or blocks):
        forms["kernel-int8"] = None
    return "+".join(forms) or policy.form(rows, False)


def has_w8a8(layout: ModelLayout) -> bool:
    """Do projections quantize their rows per token (W8A8, intquant.QuantScheme)?"""
    return any(s.activations == "int8-token" for s, _ in _projection_schemes(layout).values())


def int8_activation_schemes(
    schemes: dict[str, QuantScheme], model: object
) -> dict[str, QuantScheme]:
    """`quantization.activations: int8`: every integer projection weight quantizes its rows
    per block of 32 inputs (kernels/int8_blocks.py); refused where no weight would."""
    out = {
        name: dataclasses.replace(s, activations="int8-block")
        if takes_projection_form(name) and s.kind != "e2m1" and not s.activations
        else s
        for name, s in schemes.items()
    }
    if out == schemes:
        raise ManifestError(
            f"quantization.activations: int8 — no projection of {model} has integer weights "
            "that could read int8 rows",
            hint="leave quantization.activations out, or add quantization.weights",
        )
    return out
