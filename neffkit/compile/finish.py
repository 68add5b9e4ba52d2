"""`neffkit compile BUNDLE`: turn a lowered neuron bundle into a compiled one, on a Neuron host.

A lowered bundle (`neffkit build --lower-only`) holds every graph's HLO module, its resolved
neuronx-cc flags, the pre-sharded weights and the tokenizer; this step only runs neuronx-cc per
graph (in parallel), records each argv, compiler version, log and NEFF header, and rewrites
bundle.json. No torch, no model code, no tracing: the split Neuron teams already use in CI
(lower on CPU hosts, compile on a Neuron host, run on Trainium).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from neffkit.bundle import read_bundle, staging_dir, write_bundle_json
from neffkit.compile import neuronx_cc
from neffkit.compile.progress import Progress
from neffkit.compile.workers import worker_pool
from neffkit.errors import BundleError


def finish_bundle(
    path: Path,
    output: Path | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    progress = progress or Progress(enabled=False)
    bundle = read_bundle(path)
    data = dict(bundle.data)
    if data["target"] != "neuron" or data.get("stage") != "lowered":
        raise BundleError(
            f"{path}: not a lowered neuron bundle (target {data['target']!r}, stage "
            f"{data.get('stage', 'compiled')!r})",
            hint="`neffkit compile` finishes bundles written by `neffkit build --lower-only`",
        )
    binary = neuronx_cc.find_compiler()
    if binary is None:
        raise neuronx_cc.missing_compiler_error()
    version = neuronx_cc.compiler_version(binary)
    neuron = data["neuron"]
    dest = Path(output) if output else Path(path)
    graphs = [dict(g) for g in data["graphs"]]
    with worker_pool(jobs or os.cpu_count() or 1) as run_parallel, staging_dir(dest) as stage:
        shutil.copytree(bundle.root, stage, dirs_exist_ok=True)
        (stage / "bundle.json").unlink()
        work, names = [], []
        for g in graphs:
            stem = Path(g["hlo"]).name.removesuffix(".hlo.pb")
            args, g["compiler"] = neuronx_cc.plan_compile(
                binary, version, neuron["target"], neuron["lnc"], stem, g["flags"], stage
            )
            g["artifact"] = f"graphs/{stem}.neff"
            work.append(args)
            names.append(stem)
        (stage / "graphs").mkdir(exist_ok=True)
        progress.start("neuronx-cc", names)
        for g, done in zip(
            graphs, run_parallel(neuronx_cc.run_neuronx_cc, work, names, progress), strict=True
        ):
            g["artifact_metadata"] = {"neff_header": done["neff_header"]}
        data["graphs"] = graphs
        data["stage"] = "compiled"
        write_bundle_json(stage, data)
    return {
        "bundle": str(dest.resolve()),
        "compiler": version,
        "graphs": names,
        "seconds": round(time.perf_counter() - t0, 3),
    }
