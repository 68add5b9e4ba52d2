"""Running neuronx-cc: find it, ask its version, compile one HLO module into a NEFF.

neuronx-cc comes from the Neuron DLAMI's environment, never from PyPI (the PyPI package of that
name is a placeholder). `NEFFKIT_NEURONX_CC` names the binary explicitly; otherwise it is looked
up on PATH. The argv is rendered by compile.flags (one renderer, golden-tested); this module only
runs it, keeps the log, and turns a failure into an error that says what probably happened.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.compile.flags import neuronx_cc_argv
from neffkit.compile.progress import Progress
from neffkit.compile.units import Compiled, RunParallel
from neffkit.contract.neff import NeffError, read_header
from neffkit.contract.records import ArtifactMetadata, CompilerRecord, NeuronRecord
from neffkit.errors import BuildError

ENV_BINARY = "NEFFKIT_NEURONX_CC"
LOG_TAIL_LINES = 15

# what a signal-terminated neuronx-cc most often means, and what to do about it
SIGNAL_HINTS: dict[int, tuple[str, str]] = {
    signal.SIGKILL: (
        "was killed (SIGKILL), most often by the kernel's out-of-memory killer",
        "compile fewer graphs at once (-j 1) or on a host with more memory",
    ),
    signal.SIGABRT: (
        "aborted (SIGABRT): an internal compiler assertion failed",
        "the log names the failing pass; a per-graph rule (compiler.per_graph) can lower -O",
    ),
    signal.SIGSEGV: (
        "crashed (SIGSEGV)",
        "retry this graph with -O1 through compiler.per_graph, and report the log to Neuron",
    ),
}


@dataclass(frozen=True)
class NeffRun:
    """One neuronx-cc run, as its worker reports it."""

    seconds: float
    neff_header: dict[str, int | str]


def find_compiler() -> str | None:
    """The neuronx-cc to run, or None when this host has none."""
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise BuildError(f"{ENV_BINARY}={explicit} is not an executable file")
        return explicit
    return shutil.which("neuronx-cc")


def missing_compiler_error() -> BuildError:
    return BuildError(
        "target 'neuron' compiles with neuronx-cc, which is not on this host's PATH",
        hint=(
            "write a lowered bundle here with `neffkit build --lower-only`, then finish it on a "
            "Neuron host (DLAMI) with `neffkit compile BUNDLE`"
        ),
    )


def compiler_version(binary: str) -> str:
    """neuronx-cc's own version line (recorded per graph and part of the cache key)."""
    try:
        proc = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=120, check=False
        )
    except OSError as exc:
        raise BuildError(f"could not run {binary}: {exc}") from exc
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def plan_compile(
    binary: str,
    version: str,
    neuron_target: str,
    lnc: int,
    stem: str,
    flags: tuple[str, ...],
    stage: Path,
) -> tuple[tuple[Any, ...], CompilerRecord]:
    """run_neuronx_cc's arguments for one graph of a bundle at `stage`, and its compiler record.

    Paths in the argv are relative to the bundle (ir/<graph>.hlo.pb → graphs/<graph>.neff), so
    the recorded argv is the same on every host and reruns by hand from the bundle directory.
    """
    argv = neuronx_cc_argv(
        f"ir/{stem}.hlo.pb", f"graphs/{stem}.neff", neuron_target, lnc, list(flags)
    )
    log = f"logs/{stem}.neuronx-cc.log"
    return (binary, argv, stage, stage / log, stem), CompilerRecord(tuple(argv), version, log)


def compile_neffs(
    binary: str,
    version: str,
    neuron: NeuronRecord,
    graphs: list[tuple[str, tuple[str, ...]]],
    stage: Path,
    run_parallel: RunParallel,
    progress: Progress,
) -> list[Compiled]:
    """neuronx-cc for each (stem, flags) of a bundle at `stage`, in parallel; NEFFs land in
    graphs/. The one loop behind both `neffkit build` and `neffkit compile`."""
    work, records = [], []
    for stem, flags in graphs:
        args, record = plan_compile(binary, version, neuron.target, neuron.lnc, stem, flags, stage)
        work.append(args)
        records.append(record)
    names = [stem for stem, _ in graphs]
    (stage / "graphs").mkdir(parents=True, exist_ok=True)
    progress.start("neuronx-cc", names)
    done = run_parallel(run_neuronx_cc, work, names, progress)
    return [
        Compiled(
            stage / "graphs" / f"{stem}.neff",
            result.seconds,
            ArtifactMetadata(neff_header=result.neff_header),
            record,
        )
        for stem, result, record in zip(names, done, records, strict=True)
    ]


def run_neuronx_cc(binary: str, argv: list[str], cwd: Path, log: Path, graph: str) -> NeffRun:
    """Run one compile (argv[0] replaced by `binary`) in `cwd`; the NEFF path is argv's --output.

    Output goes to `log`. On failure the error names the graph, the exit status or signal, the
    likely cause and the log's last lines.
    """
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        try:
            proc = subprocess.run(
                [binary, *argv[1:]], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False
            )
        except OSError as exc:
            raise BuildError(f"{graph}: could not start {binary}: {exc}") from exc
    if proc.returncode != 0:
        raise compile_failure(graph, proc.returncode, log)
    neff = cwd / argv[argv.index("--output") + 1]
    try:
        header = read_header(neff)
    except (OSError, NeffError) as exc:
        raise BuildError(f"{graph}: neuronx-cc exited 0 but wrote no valid NEFF: {exc}") from exc
    return NeffRun(round(time.perf_counter() - t0, 3), header.to_json())


def compile_failure(graph: str, returncode: int, log: Path) -> BuildError:
    tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if log.exists() else []
    shown = "\n".join(f"  | {line}" for line in tail)
    if returncode < 0 and -returncode in SIGNAL_HINTS:
        what, hint = SIGNAL_HINTS[signal.Signals(-returncode)]
    elif returncode < 0:
        what, hint = f"died of signal {-returncode}", "see the log"
    else:
        what, hint = f"failed with exit status {returncode}", "see the log for the first error"
    return BuildError(
        f"{graph}: neuronx-cc {what}; log: {log}" + (f"\n{shown}" if shown else ""), hint=hint
    )
