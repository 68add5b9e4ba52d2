"""`neffkit compile BUNDLE`: turn a lowered neuron bundle into a compiled one, on a Neuron host.

A lowered bundle (`neffkit build --lower-only`) holds every graph's HLO module, its resolved
neuronx-cc flags, the pre-sharded weights and the tokenizer; this step only runs neuronx-cc per
graph (in parallel), records each argv, compiler version, log and NEFF header, and rewrites
bundle.json. No torch, no model code, no tracing: the split Neuron teams already use in CI
(lower on CPU hosts, compile on a Neuron host, run on Trainium).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

from neffkit.compile.backends.neuron import neuronx_cc
from neffkit.compile.jobs.workers import worker_pool
from neffkit.compile.progress import Progress
from neffkit.contract.bundle import write_bundle_json
from neffkit.contract.codec import JsonObject, JsonValue
from neffkit.contract.read import read_bundle
from neffkit.contract.staging import staging_dir
from neffkit.errors import BundleError
from neffkit.platform.cpus import usable_cpus


def finish_bundle(
    path: Path,
    output: Path | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> JsonObject:
    t0 = time.perf_counter()
    progress = progress or Progress(enabled=False)
    bundle = read_bundle(path)
    record = bundle.record
    if record.target != "neuron" or not record.lowered or record.neuron is None:
        raise BundleError(
            f"{path}: not a lowered neuron bundle (target {record.target!r}, stage "
            f"{record.stage or 'compiled'!r})",
            hint="`neffkit compile` finishes bundles written by `neffkit build --lower-only`",
        )
    binary = neuronx_cc.find_compiler()
    if binary is None:
        raise neuronx_cc.missing_compiler_error()
    version = neuronx_cc.compiler_version(binary)
    dest = Path(output) if output else Path(path)
    stems: list[JsonValue] = [g.stem for g in record.graphs]
    with worker_pool(jobs or usable_cpus()) as run_parallel, staging_dir(dest) as stage:
        shutil.copytree(bundle.root, stage, dirs_exist_ok=True)
        (stage / "bundle.json").unlink()
        spec = record.layout.speculation
        if spec is not None and spec.draft:  # a draft model's bundle inside: finished first
            inner = finish_bundle(stage / spec.draft, jobs=jobs, progress=progress)["graphs"]
            assert isinstance(inner, list)  # its stems, as returned below
            stems += [f"{spec.draft}/{stem}" for stem in inner]
        work = [(g.stem, g.flags) for g in record.graphs]
        done = neuronx_cc.compile_neffs(
            binary, version, record.neuron, work, stage, run_parallel, progress
        )
        graphs = tuple(
            replace(
                g,
                artifact=f"graphs/{g.stem}.neff",
                artifact_metadata=neff.metadata,
                compiler=neff.compiler,
            )
            for g, neff in zip(record.graphs, done, strict=True)
        )
        write_bundle_json(stage, replace(record, graphs=graphs, stage="compiled"))
    return {
        "bundle": str(dest.resolve()),
        "compiler": version,
        "graphs": stems,
        "seconds": round(time.perf_counter() - t0, 3),
    }
