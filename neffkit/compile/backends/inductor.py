"""cpu and cuda backends: torch.export program → AOTInductor package (.pt2), one per graph.

Weights stay graph inputs, so one copy in memory serves every graph of a rank and no package can be
run before its constants exist (an AOTInductor package whose constants are not loaded segfaults).
cpu packages are compiled with -march=native: the build host's ISA flags are recorded and the loader
refuses hosts that lack any of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neffkit import host
from neffkit.bundle import sha256_file
from neffkit.errors import BuildError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArtifactRecord:
    path: Path
    sha256: str
    size: int
    metadata: dict[str, Any]


class CpuBackend:
    name = "cpu"
    device = "cpu"
    artifact_suffix = ".pt2"

    @property
    def version(self) -> str:
        return f"torch-{torch.__version__}-aotinductor"

    def host_requirements(self) -> dict[str, Any]:
        return {"machine": host.machine(), "cpu_flags": sorted(host.cpu_flags())}

    def compile(self, program: Any, out_path: Path, options: dict[str, Any]) -> ArtifactRecord:
        """Compile one exported program into an AOTInductor package at `out_path`."""
        from torch._inductor import aoti_compile_and_package

        out_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            aoti_compile_and_package(
                program, package_path=str(out_path), inductor_configs=dict(options)
            )
        except Exception as exc:
            raise BuildError(f"AOTInductor failed for {out_path.stem}: {exc}") from exc
        metadata = torch._C._aoti.AOTIModelPackageLoader(str(out_path), "model", False, 1, -1)
        meta = dict(metadata.get_metadata())
        return ArtifactRecord(out_path, sha256_file(out_path), os.path.getsize(out_path), meta)


class CudaBackend(CpuBackend):
    name = "cuda"
    device = "cuda"

    def host_requirements(self) -> dict[str, Any]:
        if not torch.cuda.is_available():
            raise BuildError(
                "target 'cuda' needs a CUDA device and a CUDA build of torch",
                hint="build on a GPU host, or use target: cpu",
            )
        major, minor = torch.cuda.get_device_capability()
        return {"machine": host.machine(), "cuda_capability": f"{major}.{minor}"}
