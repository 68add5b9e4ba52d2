"""Cache keys: every factor that changes an artifact (and nothing else), and why a key missed.

The artifact key is the traced graph, its options and the tool versions (`unit_key`). The early
key (`trace_key`) is everything a trace is made from: the resolved manifest, model config,
checkpoint file stamps, neffkit's own source, torch and lowering versions, the graph spec and
rank; a rebuild with nothing changed then traces nothing. A wrong hit there could only come from a
factor left out; it still cannot give a wrong artifact, whose key is the traced graph. Environment
variables never enter a key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffkit.compile.units import CacheKey
from neffkit.contract.codec import JsonObject, JsonValue
from neffkit.contract.records import FORMAT_VERSION

if TYPE_CHECKING:
    from neffkit.compile.backends.base import Backend
    from neffkit.compile.units import GraphSpec, GraphUnit
    from neffkit.manifest import Manifest


def _describe(value: Any) -> str:
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) or "(none)"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    return str(value)


def changed_keys(old: dict[Any, Any], new: dict[Any, Any]) -> list[Any]:
    """The keys, sorted, whose values differ between two dicts (a key only one has counts)."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def explain_change(old: JsonObject, new: JsonObject) -> str:
    """`flags changed: -O2 → -O3; torch changed: 2.12.0 → 2.13.0`."""
    parts = []
    for name in changed_keys(old, new):
        before, after = old.get(name), new.get(name)
        if name in ("graph", "inputs", "outputs"):
            parts.append(f"{name} changed")
        elif isinstance(before, dict) and isinstance(after, dict):  # only the keys that changed
            changes = [
                f"{k}={before.get(k, '(unset)')} → {after.get(k, '(unset)')}"
                for k in changed_keys(before, after)
            ]
            parts.append(f"{name} changed: {', '.join(changes)}")
        else:
            parts.append(f"{name} changed: {_describe(before)} → {_describe(after)}")
    return "; ".join(parts) or "no factor changed (entry missing or corrupt)"


LOWERING_PACKAGES = ("torch-mlir", "jax", "jaxlib")


@functools.cache
def source_digest() -> str:
    """sha256 over neffkit's own source (Python, and the C++ kernels the graphs call): any code
    change invalidates every trace entry."""
    root = Path(__file__).resolve().parents[2]  # neffkit/
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.glob("platform/csrc/*")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def checkpoint_stamps(model_dir: Path) -> list[JsonValue]:
    """(name, size, mtime_ns) of every file in the model directory: what the trace reads."""
    return [
        [p.name, st.st_size, st.st_mtime_ns]
        for p in sorted(Path(model_dir).iterdir())
        if p.is_file() and (st := p.stat())
    ]


def _installed(names: tuple[str, ...]) -> JsonObject:
    found: JsonObject = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def trace_key(
    manifest: Manifest, backend: Backend, spec: GraphSpec, rank: int, projection: str = ""
) -> CacheKey:
    """Everything one rank's trace of one graph is made from: the early key
    (docs/design.md#caches). `projection`: the forms its projections take (cpu_kernel auto
    chooses them by measuring on the build host)."""
    import torch

    return CacheKey(
        {
            "kind": "trace",
            "manifest": manifest.to_json(),
            "model": manifest.model_config.to_json(),
            "checkpoint": checkpoint_stamps(manifest.model),
            "neffkit": source_digest(),
            "torch": torch.__version__,
            "python": list(sys.version_info[:2]),
            "lowering": _installed(LOWERING_PACKAGES) if backend.name == "neuron" else {},
            "backend": f"{backend.name} {backend.version}",
            # cpu_kernel: auto takes the kernel only where the CPU runs it
            "cpu_kernel": _cpu_kernel_runs() if backend.name == "cpu" else None,
            "cpu_isa": _cpu_isa() if backend.name == "cpu" else None,
            "projection": projection,
            "graph": asdict(spec),
            "rank": rank,
            "format": FORMAT_VERSION,
        }
    )


def _cpu_isa() -> str:
    """The CPU class the code is compiled for (native, or $NEFFKIT_CPU_ISA's)."""
    from neffkit.platform import isa

    return isa.requested()


def _cpu_kernel_runs() -> bool:
    from neffkit.platform import cpu_kernels

    return cpu_kernels.supported()


def weights_key(manifest: Manifest, rank: int, storage: JsonObject) -> CacheKey:
    """Everything one rank's weight shard is made from: the checkpoint, how it is stored (dtype,
    fp8 rescale, k/v scales: trace.weight_storage), the layout, the code."""
    par = manifest.parallel
    return CacheKey(
        {
            "kind": "weights",
            "model_dir": str(manifest.model),
            "checkpoint": checkpoint_stamps(manifest.model),
            "model": manifest.model_config.to_json(),
            "storage": storage,
            "parallel": {"tp": par.tp, "ep": par.ep},
            "rank": rank,
            "neffkit": source_digest(),
            "format": FORMAT_VERSION,
        }
    )


def unit_key(u: GraphUnit, backend: Backend, host: JsonObject, manifest: Manifest) -> CacheKey:
    import torch

    return CacheKey(
        {
            **backend.cache_factors(u, manifest),
            "graph": u.trace.graph_sha256,
            "inputs": [i.to_json() for i in u.trace.inputs],
            "outputs": [o.to_json() for o in u.trace.outputs],
            "options": dict(u.options.inductor),
            "flags": list(u.options.cache_flags()),
            "backend": f"{backend.name} {backend.version}",
            "torch": torch.__version__,
            "host": host,
            "format": FORMAT_VERSION,
        }
    )
