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
from neffkit.compile import neuronx_cc
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
# Decode graphs up to this many rows project as fused reductions on Inductor targets
# (models/llama.project); at 8 rows the two forms measured equal on the demo model.
GEMV_MAX_ROWS = 8
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
    lower_only: bool = False,
    verify: bool = False,
) -> BuildResult:
    """Build `manifest` into a bundle at `output` (or only report the plan with `dry_run`).

    `cache_dir=None` disables the artifact cache. `lower_only` (neuron) stops after lowering: the
    bundle holds HLO modules for `neffkit compile` to finish on a Neuron host. `verify` runs every
    graph against the eager model and records the result per graph.
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
    neuron = manifest.target == "neuron"
    if lower_only and not neuron:
        raise BuildError(
            f"--lower-only applies to target: neuron (this manifest's target is "
            f"{manifest.target!r})"
        )
    backend = get_backend(manifest.target)
    host = backend.host_requirements()
    if neuron and not lower_only and not dry_run and backend.compiler is None:
        raise neuronx_cc.missing_compiler_error()
    # a lowered bundle compiles nothing, so there is nothing to cache
    cache = ArtifactCache(cache_dir) if cache_dir and not lower_only else None
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
                trace_job,
                [(layout, g.spec, r, manifest.target) for g, r in pairs],
                names,
                progress,
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
                    if neuron:  # the artifact is built from the HLO: it must match too
                        check_spmd(
                            f"{g.spec.name} (HLO)",
                            [
                                RankTrace(r, t["hlo"]["sha256"], t["hlo"]["text"], [])
                                for r, t in enumerate(per_rank)
                            ],
                        )
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
                g.key = cache_key(g, backend, host, manifest)
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

            if neuron:  # the HLO modules are the compiler's input and part of the bundle
                write_hlo(stage, graphs)

            # 6. Compile the misses (in parallel); hits are copied from the cache.
            with clock("compile"):
                misses = [g for g in graphs if g.cached is None and not lower_only]
                suffix = backend.artifact_suffix
                if neuron:  # neuronx-cc writes straight into graphs/
                    compile_neffs(manifest, backend, stage, misses, run_parallel, progress)
                    if cache is not None:
                        for g in misses:
                            neff = stage / "graphs" / f"{g.stem}{suffix}"
                            cache.store(g.key, neff, _cache_extra(g))
                    counters["compiled"] = len(misses)
                    misses = []
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
                        cache.store(g.key, artifact, _cache_extra(g))
                    _place(artifact, stage / "graphs" / artifact.name)
                for g in graphs:
                    if g.cached is not None:
                        _place(g.cached, stage / "graphs" / f"{g.stem}{suffix}", copy=True)
                        g.traced.update(_cached_extra(g.cached))
                    if cache is not None:
                        cache.remember(_label(manifest, g), g.key)
                shutil.rmtree(stage / "work", ignore_errors=True)
                counters["compiled"] += len(misses)

            # 6b. Verify: every graph against the eager model (rank 0 of tp=1 builds).
            if verify:
                with clock("verify"):
                    verify_graphs(manifest, layout, stage, graphs, backend, progress)

            # 7. Bundle: ir/, tokenizer/, bundle.json; then the staging dir is renamed into place.
            with clock("write"):
                entries = []
                for g in graphs:
                    write_zst_text(stage / "ir" / f"{g.stem}.txt.zst", g.traced["canonical_text"])
                    entries.append(graph_entry(g, backend.artifact_suffix, lower_only))
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
                        **neuron_fields(manifest, backend, lower_only),
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
        gemv_max_rows=GEMV_MAX_ROWS if manifest.target in ("cpu", "cuda") else 0,
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


def cache_key(g: GraphPlan, backend: Any, host: dict[str, Any], manifest: Manifest) -> CacheKey:
    neuron: dict[str, Any] = {}
    if manifest.target == "neuron" and manifest.neuron:
        # the NEFF is compiled from the HLO module, by this neuronx-cc, for this chip and lnc
        neuron = {
            "hlo": g.traced["hlo"]["sha256"],
            "neuronx_cc": backend.compiler_version,
            "neuron_target": manifest.neuron.target,
            "lnc": manifest.neuron.lnc,
        }
    return CacheKey(
        {
            **neuron,
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


def _cache_extra(g: GraphPlan) -> dict[str, Any]:
    """What a cache entry carries besides the artifact (restored on a hit)."""
    return {k: g.traced[k] for k in ("artifact_metadata", "compiler") if k in g.traced}


def _cached_extra(artifact: Path) -> dict[str, Any]:
    entry = json.loads((artifact.parent / "key.json").read_text())
    return {k: entry[k] for k in ("artifact_metadata", "compiler") if k in entry}


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


def graph_entry(g: GraphPlan, suffix: str, lower_only: bool = False) -> dict[str, Any]:
    """The graph's record in bundle.json: deterministic (no timings), so rebuilds are identical."""
    spec, t = g.spec, g.traced
    neuron = {}
    if "hlo" in t:
        neuron = {
            "hlo": f"ir/{g.stem}.hlo.pb",
            "hlo_text": f"ir/{g.stem}.hlo.txt.zst",
            "hlo_sha256": t["hlo"]["sha256"],
            "compiler": t.get("compiler"),
        }
    return {
        **neuron,
        "name": spec.name,
        "phase": spec.phase,
        "buckets": {"rows": spec.rows, "tokens": spec.tokens, "context": spec.context},
        "artifact": None if lower_only else f"graphs/{g.stem}{suffix}",
        "verify": t.get("verify"),
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


def neuron_fields(manifest: Manifest, backend: Any, lower_only: bool) -> dict[str, Any]:
    """bundle.json's neuron section: chip, lnc, and whether NEFFs exist yet (`stage`)."""
    if manifest.target != "neuron" or manifest.neuron is None:
        return {}
    return {
        "stage": "lowered" if lower_only else "compiled",
        "neuron": {"target": manifest.neuron.target, "lnc": manifest.neuron.lnc},
    }


def write_hlo(stage: Path, graphs: list[GraphPlan]) -> None:
    """ir/<graph>.hlo.pb (what neuronx-cc reads) and ir/<graph>.hlo.txt.zst (for people)."""
    (stage / "ir").mkdir(parents=True, exist_ok=True)
    for g in graphs:
        (stage / "ir" / f"{g.stem}.hlo.pb").write_bytes(g.traced["hlo"]["proto"])
        write_zst_text(stage / "ir" / f"{g.stem}.hlo.txt.zst", g.traced["hlo"]["text"])


def compile_neffs(
    manifest: Manifest,
    backend: Any,
    stage: Path,
    misses: list[GraphPlan],
    run_parallel: Any,
    progress: Progress,
) -> None:
    """neuronx-cc per missed graph, in parallel, inside the staging dir; NEFFs land in graphs/."""
    assert manifest.neuron is not None
    work, names = [], []
    for g in misses:
        args, g.traced["compiler"] = neuronx_cc.plan_compile(
            backend.compiler,
            backend.compiler_version,
            manifest.neuron.target,
            manifest.neuron.lnc,
            g.stem,
            list(g.options.flags),
            stage,
        )
        work.append(args)
        names.append(g.stem)
    (stage / "graphs").mkdir(parents=True, exist_ok=True)
    progress.start("neuronx-cc", names)
    for g, done in zip(
        misses, run_parallel(neuronx_cc.run_neuronx_cc, work, names, progress), strict=True
    ):
        g.seconds["compile"] = done["seconds"]
        g.traced["artifact_metadata"] = {"neff_header": done["neff_header"]}


def verify_graphs(
    manifest: Manifest,
    layout: ModelLayout,
    stage: Path,
    graphs: list[GraphPlan],
    backend: Any,
    progress: Progress,
) -> None:
    """`--verify`: each graph against the eager model; a mismatch fails the build."""
    from safetensors.torch import load_file

    from neffkit.compile import verify

    if layout.par.tp > 1:
        for g in graphs:
            g.traced["verify"] = {"skipped": "tp > 1: the eager model needs every rank"}
        progress.message("verify: skipped (tp > 1 graphs need every rank to run eagerly)")
        return
    tensors = load_file(str(stage / "weights" / "rank0.safetensors"))
    weights = [tensors[w.name] for w in layout.weights]
    failed = []
    for g in graphs:
        names = [i["name"] for i in g.traced["inputs"]]
        if manifest.target == "neuron":
            runner = verify.xla_cpu_runner(g.traced["hlo"]["proto"], names, g.traced["io_alias"])
            executor = "xla-cpu (HLO)"
        else:
            artifact = stage / "graphs" / f"{g.stem}{backend.artifact_suffix}"
            runner, executor = verify.aoti_runner(artifact, names), "aotinductor"
        result = verify.verify_graph(layout, g.spec, weights, runner, executor)
        g.traced["verify"] = result.to_json()
        progress.message(
            f"verify {g.stem}: tokens {'equal' if result.tokens_equal else 'DIFFER'}, "
            f"max K/V error {result.max_kv_error:.2e} ({executor})"
        )
        if not result.ok:
            failed.append(g.stem)
    if failed:
        raise BuildError(
            f"--verify: {', '.join(failed)} disagree with the eager model",
            hint="inspect the graph (`neffkit inspect BUNDLE --graph NAME`) and the options "
            "applied to it; a bad compiler option is the usual cause",
        )


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
