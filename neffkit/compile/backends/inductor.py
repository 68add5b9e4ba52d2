"""cpu and cuda backends: torch.export program → AOTInductor package (.pt2), one per graph.

Weights stay graph inputs, so one copy in memory serves every graph of a rank and no package can be
run before its constants exist (an AOTInductor package whose constants are not loaded segfaults).
cpu packages are compiled with -march=native: the build host's ISA flags are recorded and the loader
refuses hosts that lack any of them. A build for a lower CPU class ($NEFFKIT_CPU_ISA,
platform/isa.py) compiles for that class's -march and records only its flags.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from neffkit.compile.units import BuildContext, Compiled, GraphSpec, GraphUnit, job_key
from neffkit.contract.codec import OptionValue
from neffkit.contract.records import ArtifactMetadata, HostRecord, NeuronRecord
from neffkit.errors import BuildError
from neffkit.models.forms import LANES, ProjectionPolicy
from neffkit.platform import host, isa
from neffkit.platform.aoti import load_package

if TYPE_CHECKING:
    from neffkit.compile.units import CacheFactors, ModelLayout, Runner, SpmdRunner, Traced
    from neffkit.manifest import Manifest

# cpu: projection weights stored blocked, decode graphs of up to 8 rows as register-blocked
# reductions that read each weight tile once for all rows, larger ones as bmm over the blocks
# (models/projection.py; measured with bench/batch.py on a 125M Llama, see docs/performance.md).
CPU_PROJECTION = ProjectionPolicy(
    max_rows=8, lanes=LANES, buffer_queries=True, sampler_branches=True
)
# cuda: plain weights; one decode row as a fused reduction, more rows as `mm` (cuBLAS)
CUDA_PROJECTION = ProjectionPolicy(max_rows=1, lanes=0, buffer_queries=True)


def compile_job(
    layout: ModelLayout,
    spec: GraphSpec,
    options: dict[str, OptionValue],
    out: Path,
    expected_sha: str,
    rank: int = 0,
) -> Compiled:
    """A compile worker: the graph's program (checked by its sha), compiled."""
    from neffkit.compile.jobs.workers import quiet_warnings, traced_program

    quiet_warnings()
    t0 = time.perf_counter()
    traced = traced_program(layout, spec, rank, expected_sha)
    metadata = aoti_compile(traced.program, out, options)
    return Compiled(out, round(time.perf_counter() - t0, 3), ArtifactMetadata(metadata))


def aoti_compile(
    program: torch.export.ExportedProgram, out: Path, options: dict[str, OptionValue]
) -> dict[str, str]:
    """Compile one exported program into an AOTInductor package; return its own metadata."""
    from torch._inductor import aoti_compile_and_package

    out.parent.mkdir(parents=True, exist_ok=True)
    configs: dict[str, OptionValue] = {**class_options(), **options}
    try:
        aoti_compile_and_package(program, package_path=str(out), inductor_configs=configs)
    except Exception as exc:
        raise BuildError(f"AOTInductor failed for {out.stem}: {exc}") from exc
    make_reproducible(out)
    return dict(load_package(out).get_metadata())


def class_options() -> dict[str, OptionValue]:
    """Inductor's -march and vector width for a build below its host's CPU class
    (platform/isa.py); none for a native build."""
    march, bits = isa.march(), isa.simd_bits()
    if march is None or bits is None:
        return {}
    return {"cpp.march": march, "cpp.simdlen": bits}


COMPILE_COMMENT = b"\n\n// Compile cmd\n"  # what Inductor appends to a source it compiled


def make_reproducible(package: Path) -> None:
    """Rewrite an AOTInductor package so that two compiles of one graph give the same bytes.

    The compiled libraries already agree; what differs is bookkeeping: `.data/serialization_id`
    is random, and a .cpp whose build came from Inductor's local cache carries the g++ command
    lines (with precompiled-header paths) appended as comments, while a fresh build's does not.
    The comments go, and the id becomes a digest of the package's other contents. Members keep
    their order, names, dates and storage, each 64-byte aligned as PyTorch's writer aligns them.
    """
    import hashlib
    import os
    import struct
    import zipfile

    with zipfile.ZipFile(package) as z:
        members = [(info, z.read(info)) for info in z.infolist()]
    cleaned = []
    for info, data in members:
        if info.filename.endswith(".cpp") and COMPILE_COMMENT in data:
            data = data[: data.index(COMPILE_COMMENT)] + b"\n"
        cleaned.append((info, data))
    digest = hashlib.sha256()
    for info, data in cleaned:
        if not info.filename.endswith("serialization_id"):
            digest.update(info.filename.encode() + b"\0" + data + b"\0")
    ident = str(int(digest.hexdigest(), 16))[:40].encode()  # 40 digits, as torch writes it
    tmp = package.with_name(package.name + ".tmp")
    with tmp.open("wb") as raw, zipfile.ZipFile(raw, "w") as z:
        for info, data in cleaned:
            member = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            member.compress_type, member.external_attr = info.compress_type, info.external_attr
            header_end = raw.tell() + 30 + len(info.filename.encode()) + 4  # + the extra's head
            pad = -header_end % 64
            member.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            z.writestr(member, ident if info.filename.endswith("serialization_id") else data)
    os.replace(tmp, package)


class CpuBackend:
    name = "cpu"
    device = "cpu"
    artifact_suffix = ".pt2"
    projection = CPU_PROJECTION

    @property
    def version(self) -> str:
        return f"torch-{torch.__version__}-aotinductor"

    def host_requirements(self) -> HostRecord:
        return HostRecord(machine=host.machine(), cpu_flags=isa.required_flags())

    def check_ready(self, lower_only: bool, dry_run: bool) -> None:
        if lower_only:
            raise BuildError(
                f"--lower-only applies to target: neuron (this manifest's target is {self.name!r})"
            )

    def lower(self, traced: Traced, world_size: int) -> None:
        return None  # AOTInductor compiles the exported program itself

    def cache_factors(self, unit: GraphUnit, manifest: Manifest) -> CacheFactors:
        return {}

    def write_inputs(self, stage: Path, units: list[GraphUnit]) -> None:
        pass

    def compile(self, ctx: BuildContext, stage: Path, units: list[GraphUnit]) -> list[Compiled]:
        work = [
            (
                ctx.layout,
                u.spec,
                u.options.inductor,
                stage / "work" / f"{u.stem}{self.artifact_suffix}",
                u.trace.graph_sha256,
                u.rank or 0,
            )
            for u in units
        ]
        names = [u.stem for u in units]
        keys = [job_key(u.spec, u.rank) for u in units]  # the worker that traced each graph
        ctx.progress.start("compile", names)
        return ctx.run_parallel(compile_job, work, names, ctx.progress, keys=keys)

    def verify_runner(
        self, layout: ModelLayout, unit: GraphUnit, stage: Path
    ) -> tuple[Runner, str]:
        from neffkit.compile.verify.run import aoti_runner

        artifact = stage / "graphs" / f"{unit.stem}{self.artifact_suffix}"
        return aoti_runner(artifact, [i.name for i in unit.trace.inputs]), "aotinductor"

    def spmd_runner(self, unit: GraphUnit, ranks: int) -> tuple[SpmdRunner, str] | None:
        return None

    def target_record(
        self, manifest: Manifest, lower_only: bool
    ) -> tuple[NeuronRecord | None, str | None]:
        return None, None


class CudaBackend(CpuBackend):
    name = "cuda"
    device = "cuda"
    projection = CUDA_PROJECTION

    def host_requirements(self) -> HostRecord:
        if not torch.cuda.is_available():
            raise BuildError(
                "target 'cuda' needs a CUDA device and a CUDA build of torch",
                hint="build on a GPU host, or use target: cpu",
            )
        major, minor = torch.cuda.get_device_capability()
        return HostRecord(machine=host.machine(), cuda_capability=f"{major}.{minor}")
