"""The build orchestrator: manifest → plan → trace → check → cache → compile → bundle.

Read it as numbered steps. Tracing and compiling run in worker processes (tracing holds global
state, so processes, not threads). Compile workers retrace their graph and check its sha256 against
the traced one, so the artifact is provably built from the graph that was checked. Everything is
written into a staging directory renamed onto the destination only when the bundle is complete; an
interrupt (Ctrl-C, SIGTERM) terminates the workers and removes the staging directory.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import neffkit
from neffkit.bundle import FORMAT_VERSION, staging_dir, write_bundle_json, write_zst_text
from neffkit.compile.audit import Finding, GraphFacts, audit_buckets, audit_graph, blocking
from neffkit.compile.backends import get_backend
from neffkit.compile.cache import ArtifactCache, CacheKey, explain_change
from neffkit.compile.flags import ResolvedOptions, resolve_options
from neffkit.compile.plan import GraphSpec, Plan, make_plan
from neffkit.compile.progress import Progress
from neffkit.compile.spmd import RankTrace, SPMDMismatchError, check_spmd
from neffkit.compile.trace import ModelLayout
from neffkit.compile.workers import compile_job, trace_job, worker_pool
from neffkit.errors import BuildError
from neffkit.manifest import Manifest
from neffkit.models.llama import TensorSpec
from neffkit.models.parallel import Parallelism
from neffkit.models.weights import iter_rank_weights, rank_weight_shapes

log = logging.getLogger(__name__)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass
class GraphPlan:
    """One graph's journey through the build."""

    spec: GraphSpec
    options: ResolvedOptions
    rank: int | None = None  # None: one artifact serves every rank (SPMD)
    traced: dict[str, Any] = field(default_factory=dict)
    key: CacheKey | None = None
    cached: Path | None = None
    miss_reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def stem(self) -> str:
        """File stem of the artifact and ir: per-rank graphs carry their rank."""
        return self.spec.name if self.rank is None else f"{self.spec.name}.rank{self.rank}"


@dataclass
class BuildResult:
    bundle: Path | None
    counters: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    graphs: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {
            "bundle": str(self.bundle) if self.bundle else None,
            "counters": self.counters,
            "seconds": self.seconds,
            "graphs": self.graphs,
            "warnings": self.warnings,
            "peak_rss_mb": self.peak_rss_mb,
            "findings": self.findings,
        }


def default_output(manifest: Manifest) -> Path:
    return Path("bundles") / manifest.name


def build(
    manifest: Manifest,
    output: Path | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    dry_run: bool = False,
) -> BuildResult:
    """Build `manifest` into a bundle at `output` (or only report the plan with `dry_run`).

    `cache_dir=None` disables the artifact cache.
    """
    progress = progress or Progress(enabled=False)
    jobs = jobs or os.cpu_count() or 1
    dest = Path(output) if output else default_output(manifest)
    result = BuildResult(bundle=None if dry_run else dest.resolve())
    counters = {
        "graphs": 0,
        "traced": 0,
        "spmd_groups": 0,
        "per_rank_graphs": 0,
        "compiled": 0,
        "cache_hits": 0,
    }
    backend = get_backend(manifest.target)
    host = backend.host_requirements()
    cache = ArtifactCache(cache_dir) if cache_dir else None
    clock = _Clock(result.seconds)

    # 1. Plan: graphs and their resolved compiler options.
    with clock("plan"):
        plan = make_plan(manifest)
        graphs = [GraphPlan(spec, resolve_options(manifest, spec)) for spec in plan.graphs]
        layout = model_layout(manifest, backend.device)
        for g in graphs:
            result.warnings += g.options.warnings
        for w in result.warnings:
            progress.message(f"warning: {w}")
        counters["graphs"] = len(graphs)

    with worker_pool(jobs) as run_parallel:
        # 2. Trace every graph on every rank (in parallel).
        ranks = range(plan.world_size)
        with clock("trace"):
            pairs = [(g, r) for g in graphs for r in ranks]
            names = [
                g.spec.name if plan.world_size == 1 else f"{g.spec.name}@rank{r}" for g, r in pairs
            ]
            progress.start("trace", names)
            traced = run_parallel(
                trace_job, [(layout, g.spec, r) for g, r in pairs], names, progress
            )
            counters["traced"] = len(pairs)

        # 3. Check: every rank's graph is byte-identical, so one artifact serves all (SPMD).
        with clock("check"):
            checked: list[GraphPlan] = []
            for i, g in enumerate(graphs):
                per_rank = traced[i * plan.world_size : (i + 1) * plan.world_size]
                rank_traces = [
                    RankTrace(r, t["graph_sha256"], t["canonical_text"], t.pop("sources"))
                    for r, t in enumerate(per_rank)
                ]
                try:
                    check_spmd(g.spec.name, rank_traces)
                except SPMDMismatchError as exc:
                    if not manifest.parallel.per_rank_artifacts:
                        raise
                    progress.message(
                        f"warning: {exc.message.splitlines()[0]}; compiling one "
                        "artifact per rank (parallel.per_rank_artifacts)"
                    )
                    for r, t in enumerate(per_rank):
                        unit = GraphPlan(g.spec, g.options, rank=r, traced=t)
                        unit.seconds["trace"] = t.pop("seconds")
                        checked.append(unit)
                    counters["per_rank_graphs"] += 1
                    continue
                g.traced = per_rank[0]
                g.seconds["trace"] = g.traced.pop("seconds")
                checked.append(g)
                counters["spmd_groups"] += plan.world_size > 1
            graphs = checked

        # 3b. Audit: known neuronx-cc / runtime hazards; errors fail unless the manifest waives.
        with clock("audit"):
            findings = audit_plan(manifest, graphs)
            result.findings = [f.to_json() for f in findings]
            for f in findings:
                if f.severity != "info":
                    progress.message(
                        f"{f.severity}: {f.rule} {f.graph}: {f.message}"
                        + (" (waived)" if f.waived else "")
                    )
            errors = blocking(findings)
            if errors and not dry_run:
                first = errors[0]
                raise BuildError(
                    f"{len(errors)} audit error(s); first: {first.rule} in "
                    f"{first.graph}: {first.message} at `{first.at}`",
                    hint=f"{first.fix}; or waive it with `audit: {{waive: [{first.rule}]}}`",
                )

        # 4. Cache: look each graph up by every factor that changes its artifact.
        with clock("cache"):
            for g in graphs:
                g.key = cache_key(g, backend, host)
                if cache is None:
                    continue
                g.cached = cache.lookup(g.key)
                if g.cached is None:
                    previous = cache.previous_factors(_label(manifest, g))
                    if previous is not None:
                        g.miss_reason = explain_change(previous, g.key.factors)
                        progress.message(f"{g.stem}: recompiling, {g.miss_reason}")
            counters["cache_hits"] = sum(g.cached is not None for g in graphs)
        if dry_run:
            result.graphs = [_dry_run_row(g, cache is not None) for g in graphs]
            result.counters = counters
            return result

        with staging_dir(dest) as stage:
            # 5. Weights: cast (and shard) into weights/rank{r}.safetensors.
            with clock("weights"):
                weight_records = write_weights(manifest, stage, layout)

            # 6. Compile the misses (in parallel); hits are copied from the cache.
            with clock("compile"):
                misses = [g for g in graphs if g.cached is None]
                suffix = backend.artifact_suffix
                work = [
                    (
                        manifest.target,
                        layout,
                        g.spec,
                        g.options.inductor,
                        stage / "work" / f"{g.stem}{suffix}",
                        g.traced["graph_sha256"],
                        g.rank or 0,
                    )
                    for g in misses
                ]
                names = [g.stem for g in misses]
                progress.start("compile", names)
                compiled_all = run_parallel(compile_job, work, names, progress)
                for g, compiled in zip(misses, compiled_all, strict=True):
                    g.seconds["compile"] = compiled["seconds"]
                    g.traced["artifact_metadata"] = compiled["artifact_metadata"]
                    artifact = stage / "work" / f"{g.stem}{suffix}"
                    if cache is not None:
                        cache.store(
                            g.key, artifact, {"artifact_metadata": compiled["artifact_metadata"]}
                        )
                    _place(artifact, stage / "graphs" / artifact.name)
                for g in graphs:
                    if g.cached is not None:
                        _place(g.cached, stage / "graphs" / f"{g.stem}{suffix}", copy=True)
                        g.traced["artifact_metadata"] = _cached_metadata(g.cached)
                    if cache is not None:
                        cache.remember(_label(manifest, g), g.key)
                shutil.rmtree(stage / "work", ignore_errors=True)
                counters["compiled"] = len(misses)

            # 7. Bundle: ir/, tokenizer/, bundle.json; then the staging dir is renamed into place.
            with clock("write"):
                entries = []
                for g in graphs:
                    write_zst_text(stage / "ir" / f"{g.stem}.txt.zst", g.traced["canonical_text"])
                    entries.append(graph_entry(g, backend.artifact_suffix))
                copy_tokenizer(manifest.model, stage / "tokenizer")
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
                        "layout": layout_json(plan, layout),
                        "graphs": entries,
                        "weights": weight_records,
                        "tokenizer": "tokenizer" if (stage / "tokenizer").exists() else None,
                        "audit": {
                            "waived": list(manifest.audit.waive),
                            "findings": result.findings,
                        },
                    },
                )
    result.graphs = [_report_row(g) for g in graphs]
    result.counters = counters
    result.peak_rss_mb = _peak_rss_mb()
    return result


# ---------------------------------------------------------------- steps


class _Clock:
    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = round(time.perf_counter() - t0, 3)


def model_layout(manifest: Manifest, device: str) -> ModelLayout:
    """Shapes only (safetensors headers): tracing never needs the weight values.

    Every rank's shard has the same names and shapes (that is what makes SPMD possible); this is
    checked here, before any tracing.
    """
    cfg = manifest.model_config
    par = Parallelism(manifest.parallel.tp, manifest.parallel.ep)
    shapes = rank_weight_shapes(manifest.model, cfg, par, 0)
    for rank in range(1, par.tp):
        if rank_weight_shapes(manifest.model, cfg, par, rank) != shapes:
            raise BuildError(f"rank {rank}'s weight shards differ from rank 0's in name or shape")
    specs = tuple(TensorSpec(name, shape, manifest.dtype) for name, shape in shapes)
    return ModelLayout(
        config=cfg,
        dtype=manifest.dtype,
        kv_heads=par.kv_heads_per_rank(cfg),
        weights=specs,
        block_size=manifest.kv_cache.block_size,
        num_blocks=manifest.kv_cache.num_blocks,
        max_top_k=manifest.sampling.max_top_k,
        device=device,
        par=par,
    )


def write_weights(manifest: Manifest, stage: Path, layout: ModelLayout) -> list[dict[str, Any]]:
    """weights/rank{r}.safetensors: each rank's pre-cut shard; a rank reads only its own file."""
    (stage / "weights").mkdir(parents=True)
    records = []
    for rank in range(layout.par.tp):
        tensors = dict(
            iter_rank_weights(
                manifest.model, manifest.model_config, manifest.dtype, layout.par, rank
            )
        )
        file = f"weights/rank{rank}.safetensors"
        save_file(tensors, str(stage / file))
        records.append({"rank": rank, "file": file, "names": list(tensors)})
        del tensors
    return records


def audit_plan(manifest: Manifest, graphs: list[GraphPlan]) -> list[Finding]:
    neuron = manifest.neuron.target if manifest.neuron else None
    waive = manifest.audit.waive
    findings = audit_buckets(manifest.target, list(manifest.buckets.prefill), waive)
    for g in graphs:
        facts = GraphFacts(
            g.spec.name,
            g.spec.phase,
            g.traced["canonical_text"],
            g.traced["io_alias"],
            list(g.options.flags),
            g.options.flag_origins,
            manifest.target,
            neuron,
        )
        findings += audit_graph(facts, waive)
    return findings


def cache_key(g: GraphPlan, backend: Any, host: dict[str, Any]) -> CacheKey:
    return CacheKey(
        {
            "graph": g.traced["graph_sha256"],
            "inputs": g.traced["inputs"],
            "outputs": g.traced["outputs"],
            "options": g.options.inductor,
            "flags": list(g.options.cache_flags()),
            "backend": f"{backend.name} {backend.version}",
            "torch": torch.__version__,
            "host": host,
            "format": FORMAT_VERSION,
        }
    )


def _label(manifest: Manifest, g: GraphPlan) -> str:
    return f"{manifest.name}/{g.stem}"


def _place(src: Path, dst: Path, copy: bool = False) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if copy:
        shutil.copyfile(src, dst)
    else:
        os.replace(src, dst)


def _cached_metadata(artifact: Path) -> dict[str, Any]:
    return json.loads((artifact.parent / "key.json").read_text()).get("artifact_metadata", {})


def layout_json(plan: Plan, layout: ModelLayout) -> dict[str, Any]:
    b = plan.manifest.buckets
    return {
        "world_size": plan.world_size,
        "tp": plan.manifest.parallel.tp,
        "ep": plan.manifest.parallel.ep,
        "dtype": layout.dtype,
        "num_layers": layout.config.num_layers,
        "kv_heads_per_rank": layout.kv_heads,
        "rank_input": layout.par.needs_rank_input(layout.config),
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


def graph_entry(g: GraphPlan, suffix: str) -> dict[str, Any]:
    """The graph's record in bundle.json: deterministic (no timings), so rebuilds are identical."""
    spec, t = g.spec, g.traced
    return {
        "name": spec.name,
        "phase": spec.phase,
        "buckets": {"rows": spec.rows, "tokens": spec.tokens, "context": spec.context},
        "artifact": f"graphs/{g.stem}{suffix}",
        "ir": f"ir/{g.stem}.txt.zst",
        "graph_sha256": t["graph_sha256"],
        "cache_key": g.key.digest if g.key else None,
        "options": g.options.inductor,
        "option_origins": g.options.origins,
        "flags": list(g.options.flags),
        "flag_origins": g.options.flag_origins,
        "io_alias": t["io_alias"],
        "inputs": t["inputs"],
        "outputs": t["outputs"],
        "ranks": "all" if g.rank is None else [g.rank],
        "artifact_metadata": t.get("artifact_metadata", {}),
    }


def _report_row(g: GraphPlan) -> dict[str, Any]:
    return {
        "name": g.stem,
        "cache": "hit" if g.cached else "miss",
        "miss_reason": g.miss_reason,
        "seconds": g.seconds,
        "graph_sha256": g.traced["graph_sha256"],
    }


def _dry_run_row(g: GraphPlan, caching: bool) -> dict[str, Any]:
    return {
        "name": g.spec.name,
        "phase": g.spec.phase,
        "buckets": {"rows": g.spec.rows, "tokens": g.spec.tokens, "context": g.spec.context},
        "options": g.options.inductor,
        "flags": list(g.options.flags),
        "cache": ("hit" if g.cached else "miss") if caching else "disabled",
        "miss_reason": g.miss_reason,
        "graph_sha256": g.traced["graph_sha256"],
    }


def copy_tokenizer(model_dir: Path, out: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (model_dir / name).exists()]
    if not present:
        return
    out.mkdir(parents=True)
    for name in present:
        shutil.copyfile(model_dir / name, out / name)


def _peak_rss_mb() -> dict[str, float]:
    return {
        "main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
