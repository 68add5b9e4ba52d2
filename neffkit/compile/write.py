"""The build's last steps on disk: weight shards, tokenizer, ir/, and the bundle record.

Everything is written into the staging directory; `bundle.write_bundle_json` hashes what is there.
Records are deterministic (no timings, no paths of the build host beyond the resolved manifest),
so a rebuild with nothing changed writes a byte-identical bundle.json.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import neffkit
from neffkit.compile.backends.base import Backend
from neffkit.compile.cache.keys import weights_key
from neffkit.compile.cache.local import KEY_JSON, link_or_copy
from neffkit.compile.layout import projection_form
from neffkit.compile.units import GraphUnit, ModelLayout
from neffkit.contract.bundle import write_bundle_json, write_zst_text
from neffkit.contract.fp8 import Fp8Record
from neffkit.contract.records import (
    AuditRecord,
    BucketLists,
    BundleRecord,
    FindingRecord,
    GraphBuckets,
    GraphRecord,
    KernelTiming,
    LayoutRecord,
    ManifestRecord,
    ModelRecord,
    PoolingRecord,
    SpeculationRecord,
    Versions,
    WeightsRecord,
)
from neffkit.contract.tensor_files import write_tensors
from neffkit.manifest import Manifest
from neffkit.models.forms import Storage
from neffkit.models.weights import iter_rank_weights, rank_weight_specs

if TYPE_CHECKING:
    from neffkit.compile.cache import Cache

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def write_weights(
    manifest: Manifest, stage: Path, layout: ModelLayout, cache: Cache | None = None
) -> tuple[list[WeightsRecord], dict[str, int]]:
    """weights/rank{r}.safetensors: each rank's pre-cut shard; a rank reads only its own file.

    Streamed tensor by tensor (the build never holds a whole shard). With a cache, a shard whose
    checkpoint, dtype, layout and code are unchanged is linked from the cache (reflink, hardlink or
    copy: returned counts say which), not cut again."""
    (stage / "weights").mkdir(parents=True)
    records, placed = [], {"cut": 0, "reflink": 0, "hardlink": 0, "copy": 0}
    storage = layout.storage
    for rank in range(layout.par.tp):
        file = f"weights/rank{rank}.safetensors"
        key = weights_key(manifest, rank, asdict(storage))
        hit = cache.lookup(key) if cache is not None else None
        if hit is not None:
            placed[link_or_copy(hit, stage / file)] += 1
            names = json.loads((hit.parent / KEY_JSON).read_text())["names"]
        else:
            args = (manifest.model, manifest.model_config, storage, layout.par, rank)
            names = write_tensors(stage / file, rank_weight_specs(*args), iter_rank_weights(*args))
            placed["cut"] += 1
            if cache is not None:
                cache.store(key, stage / file, {"names": list(names)}, link=True)
        records.append(WeightsRecord(rank, file, tuple(names)))
    return records, placed


def copy_tokenizer(model_dir: Path, out: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (model_dir / name).exists()]
    if not present:
        return
    out.mkdir(parents=True)
    for name in present:
        shutil.copyfile(model_dir / name, out / name)


def graph_record(u: GraphUnit, suffix: str, lower_only: bool, layout: ModelLayout) -> GraphRecord:
    """The graph's record in bundle.json: deterministic (no build timings; cpu_kernel auto's
    measurement is kept per host), so rebuilds are identical."""
    spec, t = u.spec, u.trace
    lowered = t.lowered  # neuron graphs only: the HLO fields
    return GraphRecord(
        name=spec.name,
        phase=spec.phase,
        buckets=GraphBuckets(spec.rows, spec.tokens, spec.context),
        artifact=None if lower_only else f"graphs/{u.stem}{suffix}",
        ir=f"ir/{u.stem}.txt.zst",
        graph_sha256=t.graph_sha256,
        cache_key=u.key.digest if u.key else None,
        options=u.options.inductor,
        option_origins=u.options.origins,
        flags=u.options.flags,
        flag_origins=u.options.flag_origins,
        io_alias=t.io_alias,
        inputs=t.inputs,
        outputs=t.outputs,
        ranks="all" if u.rank is None else (u.rank,),
        artifact_metadata=u.metadata,
        verify=u.verify,
        projection=projection_form(layout, spec.rows * spec.tokens),
        kernel_timing=_kernel_timing(layout, spec.rows * spec.tokens),
        attention="kernel" if layout.projection.attends_in_kernel(spec.phase, spec.rows) else None,
        hlo=None if lowered is None else f"ir/{u.stem}.hlo.pb",
        hlo_text=None if lowered is None else f"ir/{u.stem}.hlo.txt.zst",
        hlo_sha256=None if lowered is None else lowered.sha256,
        compiler=None if lowered is None else u.compiler,
    )


def _kernel_timing(layout: ModelLayout, rows: int) -> KernelTiming | None:
    """What cpu_kernel auto measured for a graph of `rows` rows, if it measured (kept per host,
    so a rebuild here records the same figures)."""
    for t in layout.kernel_timings:
        if t.rows == rows:
            return KernelTiming(t.kernel_ms, t.inductor_ms, t.chosen, t.kernel_all_ms)
    return None


DRAFT_DIR = "draft"  # a draft model's bundle, inside the target's


def _speculation(manifest: Manifest) -> SpeculationRecord | None:
    spec = manifest.speculation
    if spec is None:
        return None
    return SpeculationRecord(
        spec.method,
        spec.num_tokens,
        spec.max_batch,
        spec.prompt_lookup_min,
        spec.prompt_lookup_max,
        DRAFT_DIR if spec.method in ("draft", "mtp") else "",
    )


def layout_record(manifest: Manifest, layout: ModelLayout) -> LayoutRecord:
    b = manifest.buckets
    return LayoutRecord(
        world_size=manifest.parallel.tp,
        tp=manifest.parallel.tp,
        ep=manifest.parallel.ep,
        dtype=layout.dtype,
        num_layers=layout.config.num_layers,
        kv_heads_per_rank=layout.kv_heads,
        rank_input=layout.config.needs_rank_input(layout.par),
        head_dim=layout.config.kv_width,
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        buckets=BucketLists(b.prefill, b.decode, b.context, b.prefill_batch),
        max_top_k=layout.max_top_k,
        max_logprobs=layout.max_logprobs,
        prompt_logprobs=layout.prompt_logprobs,
        # an embedding pools every token's state: none may come from another request's blocks
        prefix_caching=manifest.kv_cache.prefix_caching and manifest.embedding is None,
        speculation=_speculation(manifest),
        kv_kind=layout.config.kv_kind,
        kv_dtype=layout.kv_dtype,
        decode_state=layout.decode_state,
        bitmask_words=layout.bitmask_words,
        penalty_tokens=layout.penalty_tokens,
        bias_tokens=layout.bias_tokens,
        lora=layout.lora,
        kv_groups=layout.kv_groups,
        pooling=_pooling(manifest, layout),
    )


def _pooling(manifest: Manifest, layout: ModelLayout) -> PoolingRecord | None:
    embed = manifest.embedding
    if embed is None:
        return None
    return PoolingRecord(embed.pooling, embed.normalize, layout.config.hidden_size)


def write_bundle(
    manifest: Manifest,
    layout: ModelLayout,
    backend: Backend,
    stage: Path,
    units: list[GraphUnit],
    weights: list[WeightsRecord],
    findings: list[FindingRecord],
    lower_only: bool,
) -> BundleRecord:
    """ir/, tokenizer/ and bundle.json into the staging directory."""
    for u in units:
        write_zst_text(stage / "ir" / f"{u.stem}.txt.zst", u.trace.canonical_text)
    copy_tokenizer(manifest.model, stage / "tokenizer")
    neuron, bundle_stage = backend.target_record(manifest, lower_only)
    graphs = tuple(graph_record(u, backend.artifact_suffix, lower_only, layout) for u in units)
    model = layout.config.to_json()  # with the schemes of its quantized weights
    record = BundleRecord(
        versions=Versions(neffkit.__version__, torch.__version__, backend.version),
        target=manifest.target,
        host=backend.host_requirements(),
        manifest=ManifestRecord.from_json(manifest.to_json()),
        model=ModelRecord.from_json(model),
        layout=layout_record(manifest, layout),
        graphs=graphs,
        weights=tuple(weights),
        tokenizer="tokenizer" if (stage / "tokenizer").exists() else None,
        audit=AuditRecord(manifest.audit.waive, tuple(findings)),
        neuron=neuron,
        stage=bundle_stage,
        fp8=fp8_record(manifest, layout.storage),
        kernels=copy_kernels(stage, graphs),
    )
    return write_bundle_json(stage, record)


def copy_kernels(stage: Path, graphs: tuple[GraphRecord, ...]) -> tuple[str, ...]:
    """The kernel library, into kernels/ when a graph calls it (the runtime loads it from
    there: no compiler on the serving host)."""
    forms = [(g.projection or "").split("+") for g in graphs]  # kernel-rows, -packed, -int8
    calls = any(f.startswith("kernel-") for form in forms for f in form)
    if not calls and not any(g.attention for g in graphs):
        return ()
    from neffkit.platform import cpu_kernels

    relative = f"kernels/{cpu_kernels.LIBRARY_NAME}"
    (stage / "kernels").mkdir(exist_ok=True)
    shutil.copyfile(cpu_kernels.build_library(), stage / relative)
    return (relative,)


def fp8_record(manifest: Manifest, storage: Storage) -> Fp8Record | None:
    """What bundle.json says about fp8: a trn1/trn2 and a trn3 build of one fp8 manifest differ
    exactly in `max`, the rescales and the compiler flag."""
    if not manifest.uses_fp8:
        return None
    block = manifest.model_config.fp8_block
    fp8_kv = manifest.fp8_kv_cache
    return Fp8Record(
        max=manifest.fp8_max,
        weights=fp8_layout(block),
        weight_block=tuple(block),
        weight_rescale=storage.fp8_rescale,
        scale_rescale=1.0 / storage.fp8_rescale,
        kv_cache=fp8_kv,
        kv_scales=_kv_scale_source(storage) if fp8_kv else "",
        k_scales=tuple(k for k, _ in storage.kv_calibrated) if storage.kv_calibrated else None,
        v_scales=tuple(v for _, v in storage.kv_calibrated) if storage.kv_calibrated else None,
        keys=_stored_keys(storage),  # rotated keys imply an fp8 cache
    )


def _stored_keys(storage: Storage) -> str | None:
    if not storage.rotate_keys:
        return None
    return "centered, weighted, rotated"


def _kv_scale_source(storage: Storage) -> str:
    if storage.kv_calibrated is not None:
        return "calibrated"
    return "checkpoint" if storage.kv_scales else "1.0"


def fp8_layout(block: tuple[int, ...]) -> str:
    """A scale block's common name."""
    if not block:
        return ""
    names: dict[tuple[int, ...], str] = {(0, 0): "tensor", (1, 0): "channel"}
    return names.get(tuple(block), "block")
