"""Compiler options as data: merged base → manifest → per-graph rules, rendered once per graph.

For cpu/cuda the options are AOTInductor config keys from the manifest's allow-list; each resolved
option records its origin ("base", "manifest", "rule N") so bundle.json and inspect can say why a
graph got what it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neffkit.compile.plan import GraphSpec
from neffkit.manifest import Manifest

# Options every cpu/cuda graph gets before the manifest is read.
BASE_INDUCTOR_OPTIONS: dict[str, Any] = {}


@dataclass(frozen=True)
class ResolvedOptions:
    inductor: dict[str, Any]
    origins: dict[str, str]  # option → "base" | "manifest" | "rule N"
    flags: tuple[str, ...]  # compiler argv (neuron target)


def resolve_options(manifest: Manifest, spec: GraphSpec) -> ResolvedOptions:
    options: dict[str, Any] = {}
    origins: dict[str, str] = {}
    layers: list[tuple[str, dict[str, Any]]] = [
        ("base", BASE_INDUCTOR_OPTIONS),
        ("manifest", manifest.compiler.inductor),
    ]
    layers += [
        (f"rule {i}", rule.inductor)
        for i, rule in enumerate(manifest.compiler.per_graph)
        if spec.matches(rule.match)
    ]
    for origin, layer in layers:
        for key, value in layer.items():
            options[key] = value
            origins[key] = origin
    flags = list(manifest.compiler.flags)
    for rule in manifest.compiler.per_graph:
        if spec.matches(rule.match):
            flags += rule.flags
    return ResolvedOptions(
        inductor=dict(sorted(options.items())), origins=origins, flags=tuple(flags)
    )
