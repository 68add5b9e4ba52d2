"""The build's view of the cache: each graph unit's key, its hit or why it missed, and storing
what a hit must restore (artifact metadata, the compiler record).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.compile.cache.keys import explain_change, unit_key
from neffkit.compile.cache.local import KEY_JSON
from neffkit.contract.codec import JsonObject
from neffkit.contract.records import ArtifactMetadata, CompilerRecord

if TYPE_CHECKING:
    from neffkit.compile.backends.base import Backend
    from neffkit.compile.cache import Cache
    from neffkit.compile.progress import Progress
    from neffkit.compile.units import GraphUnit
    from neffkit.manifest import Manifest


def lookup_units(
    cache: Cache | None,
    units: list[GraphUnit],
    backend: Backend,
    manifest: Manifest,
    progress: Progress,
) -> None:
    """Each unit's cache key, and its cached artifact or why it missed."""
    host = backend.host_requirements().to_json()
    for u in units:
        u.key = unit_key(u, backend, host, manifest)
        if cache is None:
            continue
        u.cached = cache.lookup(u.key)
        if u.cached is None:
            previous = cache.previous_factors(_label(manifest, u))
            if previous is not None:
                u.miss_reason = explain_change(previous, u.key.factors)
                progress.message(f"{u.stem}: recompiling, {u.miss_reason}")


def store_unit(cache: Cache, u: GraphUnit, artifact: Path) -> None:
    """Cache a freshly compiled artifact with what a hit must restore (metadata, compiler)."""
    assert u.key is not None
    extra: JsonObject = {"artifact_metadata": u.metadata.to_json()}
    if u.compiler is not None:
        extra["compiler"] = u.compiler.to_json()
    cache.store(u.key, artifact, extra)


def restore_unit(u: GraphUnit) -> None:
    """A hit's artifact metadata and compiler record, from its entry's key.json."""
    assert u.cached is not None
    entry = json.loads((u.cached.parent / KEY_JSON).read_text())
    compiler = entry.get("compiler")
    u.metadata = ArtifactMetadata.from_json(entry.get("artifact_metadata", {}))
    u.compiler = CompilerRecord.from_json(compiler) if compiler else None


def remember_unit(cache: Cache, manifest: Manifest, u: GraphUnit) -> None:
    assert u.key is not None
    cache.remember(_label(manifest, u), u.key)


def _label(manifest: Manifest, u: GraphUnit) -> str:
    return f"{manifest.name}/{u.stem}"
