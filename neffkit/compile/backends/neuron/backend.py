"""neuron backend: exported program → HloModuleProto (lowering, any host) → NEFF (neuronx-cc).

Lowering runs where the build runs (CPU CI hosts included) and is proven there on XLA:CPU; the
NEFF step needs neuronx-cc, so a host without it writes a *lowered* bundle (`--lower-only`) that
`neffkit compile` finishes on a Neuron host. Nothing here imports a Neuron package.
"""

from __future__ import annotations

from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.compile.backends.neuron import neuronx_cc
from neffkit.compile.backends.neuron.lower import lower_program, require_lower_extra
from neffkit.compile.units import BuildContext, Compiled, GraphUnit, LoweredGraph
from neffkit.contract.bundle import write_zst_text
from neffkit.contract.records import HostRecord, NeuronRecord
from neffkit.models.forms import PLAIN

if TYPE_CHECKING:
    from neffkit.compile.units import CacheFactors, ModelLayout, Runner, SpmdRunner, Traced
    from neffkit.manifest import Manifest


class NeuronBackend:
    name = "neuron"
    device = "cpu"  # where graphs are traced; they run on NeuronCores
    artifact_suffix = ".neff"
    projection = PLAIN  # `dot`, plain weights: the TensorEngine's matmul

    def __init__(self) -> None:
        require_lower_extra()

    @property
    def version(self) -> str:
        """The lowering stack's versions (the compiler's own is recorded per graph)."""
        return f"torch-mlir-{_dist_version('torch-mlir')} jaxlib-{_dist_version('jaxlib')}"

    @cached_property
    def compiler(self) -> str | None:
        return neuronx_cc.find_compiler()

    @cached_property
    def compiler_version(self) -> str:
        return neuronx_cc.compiler_version(self.compiler) if self.compiler else "none"

    def host_requirements(self) -> HostRecord:
        # a NEFF is not tied to the build host; the Trainium generation and lnc are checked from
        # the manifest's `neuron` section and each NEFF's header at load time
        return HostRecord()

    def check_ready(self, lower_only: bool, dry_run: bool) -> None:
        if not (lower_only or dry_run) and self.compiler is None:
            raise neuronx_cc.missing_compiler_error()

    def lower(self, traced: Traced, world_size: int) -> LoweredGraph:
        return lower_program(
            traced.program, [s.name for s in traced.inputs], traced.io_alias, world_size
        )

    def cache_factors(self, unit: GraphUnit, manifest: Manifest) -> CacheFactors:
        # the NEFF is compiled from the HLO module, by this neuronx-cc, for this chip and lnc
        chip = _chip(manifest)
        return {
            "hlo": _lowered(unit).sha256,
            "neuronx_cc": self.compiler_version,
            "neuron_target": chip.target,
            "lnc": chip.lnc,
        }

    def write_inputs(self, stage: Path, units: list[GraphUnit]) -> None:
        """ir/<graph>.hlo.pb (what neuronx-cc reads) and ir/<graph>.hlo.txt.zst (for people)."""
        (stage / "ir").mkdir(parents=True, exist_ok=True)
        for u in units:
            (stage / "ir" / f"{u.stem}.hlo.pb").write_bytes(_lowered(u).proto)
            write_zst_text(stage / "ir" / f"{u.stem}.hlo.txt.zst", _lowered(u).text)

    def compile(self, ctx: BuildContext, stage: Path, units: list[GraphUnit]) -> list[Compiled]:
        assert self.compiler is not None  # check_ready refused a build without one
        graphs = [(u.stem, u.options.flags) for u in units]
        return neuronx_cc.compile_neffs(
            self.compiler,
            self.compiler_version,
            _chip(ctx.manifest),
            graphs,
            stage,
            ctx.run_parallel,
            ctx.progress,
        )

    def verify_runner(
        self, layout: ModelLayout, unit: GraphUnit, stage: Path
    ) -> tuple[Runner, str]:
        from neffkit.compile.verify.run import xla_cpu_runner

        names = [i.name for i in unit.trace.inputs]
        runner = xla_cpu_runner(
            _lowered(unit).proto, names, unit.trace.io_alias, len(unit.trace.outputs)
        )
        return runner, "xla-cpu (HLO)"

    def spmd_runner(self, unit: GraphUnit, ranks: int) -> tuple[SpmdRunner, str] | None:
        from neffkit.compile.verify.run import xla_spmd_runner

        proto = _lowered(unit).proto
        names = [i.name for i in unit.trace.inputs]
        runner = xla_spmd_runner(proto, names, unit.trace.io_alias, len(unit.trace.outputs), ranks)
        return runner, f"xla-cpu (HLO, {ranks} host devices)"

    def target_record(
        self, manifest: Manifest, lower_only: bool
    ) -> tuple[NeuronRecord | None, str | None]:
        """The chip and lnc, and whether NEFFs exist yet (`stage`)."""
        return _chip(manifest), "lowered" if lower_only else "compiled"


def _chip(manifest: Manifest) -> NeuronRecord:
    assert manifest.neuron is not None  # the manifest fills it in for target: neuron
    return NeuronRecord(manifest.neuron.target, manifest.neuron.lnc)


def _lowered(unit: GraphUnit) -> LoweredGraph:
    assert unit.trace.lowered is not None  # every neuron trace is lowered (workers.trace_job)
    return unit.trace.lowered


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"
