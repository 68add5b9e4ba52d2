"""The build orchestrator: manifest → plan → weights → trace + compile per graph → bundle.

Read it as numbered steps. Graphs are traced and compiled in worker processes (tracing holds global
state, so processes, not threads); everything is written into a staging directory that is renamed
onto the destination only when the whole bundle is complete.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import neffkit
from neffkit.bundle import staging_dir, write_bundle_json, write_zst_text
from neffkit.compile.backends import get_backend
from neffkit.compile.flags import resolve_options
from neffkit.compile.plan import GraphSpec, Plan, make_plan
from neffkit.compile.progress import Progress
from neffkit.compile.trace import ModelLayout, trace_graph
from neffkit.manifest import Manifest
from neffkit.models.llama import TensorSpec
from neffkit.models.weights import iter_weights

log = logging.getLogger(__name__)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class GraphJob:
    """Everything a worker needs to trace and compile one graph (picklable)."""

    target: str
    layout: ModelLayout
    spec: GraphSpec
    options: dict[str, Any]
    artifact: Path


@dataclass
class BuildResult:
    bundle: Path
    counters: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    graphs: list[dict[str, Any]] = field(default_factory=list)


def default_output(manifest: Manifest) -> Path:
    return Path("bundles") / manifest.name


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)


def build(
    manifest: Manifest,
    output: Path | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> BuildResult:
    progress = progress or Progress(enabled=False)
    dest = Path(output) if output else default_output(manifest)
    jobs = jobs or default_jobs()
    result = BuildResult(bundle=dest.resolve())
    counters = {"traced": 0, "compiled": 0, "cache_hits": 0, "graphs": 0}
    backend = get_backend(manifest.target)
    host = backend.host_requirements()

    # 1. Plan: which graphs, with which options.
    t0 = time.perf_counter()
    plan = make_plan(manifest)
    counters["graphs"] = len(plan.graphs)
    result.seconds["plan"] = time.perf_counter() - t0

    with staging_dir(dest) as stage:
        # 2. Weights: cast, (shard), write weights/rank{r}.safetensors.
        t0 = time.perf_counter()
        layout, weight_records = _write_weights(manifest, stage, backend.device)
        result.seconds["weights"] = time.perf_counter() - t0

        # 3. Trace + compile each graph in worker processes.
        t0 = time.perf_counter()
        jobs_list = [
            GraphJob(
                manifest.target,
                layout,
                spec,
                resolve_options(manifest, spec).inductor,
                stage / "graphs" / f"{spec.name}{backend.artifact_suffix}",
            )
            for spec in plan.graphs
        ]
        graph_results = _run_jobs(jobs_list, jobs, progress)
        counters["traced"] += len(graph_results)
        counters["compiled"] += len(graph_results)
        result.seconds["trace_compile"] = time.perf_counter() - t0

        # 4. Bundle: ir/, tokenizer/, bundle.json.
        t0 = time.perf_counter()
        graphs = []
        for spec in plan.graphs:
            res = graph_results[spec.name]
            write_zst_text(stage / "ir" / f"{spec.name}.txt.zst", res.pop("canonical_text"))
            graphs.append(_graph_entry(manifest, spec, res, backend.artifact_suffix))
        _copy_tokenizer(manifest.model, stage / "tokenizer")
        write_bundle_json(
            stage,
            {
                "versions": {
                    "neffkit": neffkit.__version__,
                    "torch": torch.__version__,
                    "backend": backend.version,
                },
                "target": manifest.target,
                "host": host,
                "manifest": manifest.to_json(),
                "model": manifest.model_config.to_json(),
                "layout": _layout_json(plan, layout),
                "graphs": graphs,
                "weights": weight_records,
                "tokenizer": "tokenizer" if (stage / "tokenizer").exists() else None,
            },
        )
        result.seconds["write"] = time.perf_counter() - t0
        result.graphs = graphs
    result.counters = counters
    return result


def _write_weights(manifest: Manifest, stage: Path, device: str) -> tuple[ModelLayout, list[dict]]:
    cfg = manifest.model_config
    tensors = dict(iter_weights(manifest.model, cfg, manifest.dtype))
    (stage / "weights").mkdir(parents=True)
    file = "weights/rank0.safetensors"
    save_file(tensors, str(stage / file))
    specs = tuple(TensorSpec(name, tuple(t.shape), manifest.dtype) for name, t in tensors.items())
    layout = ModelLayout(
        config=cfg,
        dtype=manifest.dtype,
        kv_heads=cfg.num_kv_heads,
        weights=specs,
        block_size=manifest.kv_cache.block_size,
        num_blocks=manifest.kv_cache.num_blocks,
        max_top_k=manifest.sampling.max_top_k,
        device=device,
    )
    return layout, [{"rank": 0, "file": file, "names": list(tensors)}]


def _layout_json(plan: Plan, layout: ModelLayout) -> dict[str, Any]:
    b = plan.manifest.buckets
    return {
        "world_size": plan.world_size,
        "tp": plan.manifest.parallel.tp,
        "ep": plan.manifest.parallel.ep,
        "dtype": layout.dtype,
        "num_layers": layout.config.num_layers,
        "kv_heads_per_rank": layout.kv_heads,
        "head_dim": layout.config.head_dim,
        "block_size": layout.block_size,
        "num_blocks": layout.num_blocks,
        "buckets": {
            "prefill": list(b.prefill),
            "decode": list(b.decode),
            "context": list(b.context),
        },
        "max_top_k": layout.max_top_k,
    }


def _graph_entry(manifest: Manifest, spec: GraphSpec, res: dict[str, Any], suffix: str) -> dict:
    options = resolve_options(manifest, spec)
    return {
        "name": spec.name,
        "phase": spec.phase,
        "buckets": {"rows": spec.rows, "tokens": spec.tokens, "context": spec.context},
        "artifact": f"graphs/{spec.name}{suffix}",
        "ir": f"ir/{spec.name}.txt.zst",
        "graph_sha256": res["graph_sha256"],
        "options": options.inductor,
        "option_origins": options.origins,
        "flags": list(options.flags),
        "io_alias": res["io_alias"],
        "inputs": res["inputs"],
        "outputs": res["outputs"],
        "ranks": "all",
        "artifact_metadata": res["artifact_metadata"],
        "seconds": res["seconds"],
    }


def _copy_tokenizer(model_dir: Path, out: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (model_dir / name).exists()]
    if not present:
        return
    out.mkdir(parents=True)
    for name in present:
        shutil.copyfile(model_dir / name, out / name)


# ---------------------------------------------------------------- workers


def build_graph(job: GraphJob) -> dict[str, Any]:
    """Trace and compile one graph; runs in a worker process."""
    # torch's own pytree deprecation noise, emitted while AOTInductor pickles specs
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    t0 = time.perf_counter()
    traced = trace_graph(job.layout, job.spec)
    t1 = time.perf_counter()
    record = get_backend(job.target).compile(traced.program, job.artifact, job.options)
    t2 = time.perf_counter()
    return {
        "name": job.spec.name,
        "canonical_text": traced.canonical_text,
        "graph_sha256": traced.graph_sha256,
        "io_alias": traced.io_alias,
        "inputs": [_spec_json(s) for s in traced.inputs],
        "outputs": [_spec_json(s) for s in traced.outputs],
        "artifact_metadata": record.metadata,
        "seconds": {"trace": round(t1 - t0, 3), "compile": round(t2 - t1, 3)},
    }


def _spec_json(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "shape": list(spec.shape), "dtype": spec.dtype}


def _run_jobs(jobs: list[GraphJob], workers: int, progress: Progress) -> dict[str, dict]:
    results: dict[str, dict] = {}
    progress.start("trace+compile", [job.spec.name for job in jobs])
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            results[job.spec.name] = build_graph(job)
            progress.done(job.spec.name, results[job.spec.name]["seconds"])
        return results
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        futures = {pool.submit(build_graph, job): job for job in jobs}
        try:
            for future in as_completed(futures):
                res = future.result()
                results[res["name"]] = res
                progress.done(res["name"], res["seconds"])
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return results
