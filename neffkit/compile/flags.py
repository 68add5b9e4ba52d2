"""Compiler options as data: parsed, merged base → manifest → per-graph rules, rendered once.

Two kinds of options, one resolution:
- AOTInductor config keys (cpu/cuda), from the manifest's allow-list; later layers override.
- neuronx-cc argv (neuron). Rules (what vllm-neuron learned of neuronx-cc; docs/manifest.md):
  * one optimisation level: `-O1`/`-O2`/`-O3` (or `--optlevel N`); the last one wins;
  * every `--internal-hlo2tensorizer-options` is merged into ONE string, because neuronx-cc keeps
    only the last occurrence and silently drops the others;
  * `--model-type` last wins, with a warning when it overrides the injected (base) value;
  * any other flag repeated with the same value is reported as a duplicate, with another value as
    a conflict (the last wins).
Each rendered flag records its origin ("base", "fp8", "manifest", "rule N"; "fp8": the
e4m3fn-as-e4m3 flag neffkit adds on trn1/trn2 when a graph holds fp8 values). Path-bearing flags
(log files, work dirs) are kept in the argv but left out of cache keys. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffkit.compile.units import GraphSpec, ResolvedOptions
from neffkit.contract.codec import OptionValue
from neffkit.errors import ManifestError
from neffkit.manifest import Manifest
from neffkit.targets import E4M3FN_MAX, FP8_AS_E4M3_FLAG

HLO2TENSORIZER = "--internal-hlo2tensorizer-options"
LNC_FLAG = "--logical-nc-config"  # the CLI reference's long form (also `-lnc`)
MODEL_TYPE = "--model-type"
OPT_LEVEL = "-O"

# What every neuron graph gets before the manifest is read (vllm-neuron's native-route set).
BASE_NEURON_FLAGS: tuple[str, ...] = (
    "--auto-cast=none",
    "-O2",
    f"{HLO2TENSORIZER}=--modular-flow-mac-threshold=10",
    "--internal-backend-options=--enable-verifier=false --enable-nested-dynamic-loop",
    f"{MODEL_TYPE}=transformer",
)
# Realise (store once) any reused expression of more than 16 ops. Inductor's CPU default (50)
# inlined the rotated query into the attention-score reduction, recomputing pow/cos/sin for every
# context position of every layer: demo model, decode batch 1, 0.35 ms → 0.20 ms per step.
# The host code that calls the kernels compiled at -O0 (Inductor's default -O1): it only calls
# library functions, and g++ spends most of a graph's compile optimising it. SmolLM2, bf16,
# three graphs: 147 → 106 s of compile, decode steps unchanged (docs/manifest.md).
BASE_INDUCTOR_OPTIONS: dict[str, OptionValue] = {
    "aot_inductor.compile_wrapper_opt_level": "O0",
    "realize_opcount_threshold": 16,
}


@dataclass(frozen=True)
class Flag:
    name: str  # "-O", "--model-type", "--auto-cast", ...
    value: str | None
    origin: str

    def render(self) -> str:
        if self.name == OPT_LEVEL:
            return f"-O{self.value}"
        return self.name if self.value is None else f"{self.name}={self.value}"


def parse_flags(argv: tuple[str, ...] | list[str], origin: str, where: str = "") -> list[Flag]:
    """argv → Flags. Accepts `--k=v`, `--k v`, bare `--k`, `-O3` and `--optlevel N`.

    `where` names the manifest field for errors (e.g. `compiler.per_graph[1].flags`).
    """
    where = where or origin
    flags: list[Flag] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-"):
            raise ManifestError(f"{where}: {token!r} is not a flag (flags start with '-')")
        if token.startswith("-O") and not token.startswith("--"):
            level = token[2:]
            if level not in ("1", "2", "3"):
                raise ManifestError(f"{where}: {token!r}: optimisation level must be 1, 2 or 3")
            flags.append(Flag(OPT_LEVEL, level, origin))
            i += 1
            continue
        if "=" in token:
            name, value = token.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            name, value = token, argv[i + 1]
            i += 1
        else:
            name, value = token, None
        if name == "--optlevel":
            name = OPT_LEVEL
        flags.append(Flag(name, value, origin))
        i += 1
    return flags


def merge_flags(flags: list[Flag]) -> tuple[list[Flag], list[str]]:
    """Apply the documented rules; return the merged flags (first-seen order) and warnings."""
    merged: dict[str, Flag] = {}
    warnings: list[str] = []
    h2t_parts: list[str] = []
    h2t_origins: list[str] = []
    for flag in flags:
        if flag.name == HLO2TENSORIZER:
            for part in (flag.value or "").split():
                if part not in h2t_parts:
                    h2t_parts.append(part)
            if flag.origin not in h2t_origins:
                h2t_origins.append(flag.origin)
            merged.setdefault(HLO2TENSORIZER, flag)
            continue
        old = merged.get(flag.name)
        if old is not None:
            if old.value == flag.value:
                warnings.append(f"duplicate flag {flag.render()} ({old.origin}, {flag.origin})")
            elif flag.name == MODEL_TYPE and old.origin == "base":
                warnings.append(
                    f"--model-type={flag.value} ({flag.origin}) overrides the injected "
                    f"--model-type={old.value}"
                )
            elif flag.name not in (OPT_LEVEL, MODEL_TYPE):
                warnings.append(
                    f"conflicting flags {old.render()} ({old.origin}) and "
                    f"{flag.render()} ({flag.origin}); the last wins"
                )
        merged[flag.name] = flag if old is None else Flag(flag.name, flag.value, flag.origin)
    if HLO2TENSORIZER in merged:
        merged[HLO2TENSORIZER] = Flag(HLO2TENSORIZER, " ".join(h2t_parts), "+".join(h2t_origins))
    return list(merged.values()), warnings


def _layers(manifest: Manifest, spec: GraphSpec) -> list[tuple[str, str, tuple[str, ...], dict]]:
    """(origin, manifest field, flags, inductor options) from lowest to highest precedence."""
    base_flags = BASE_NEURON_FLAGS if manifest.target == "neuron" else ()
    layers = [("base", "base flags", base_flags, BASE_INDUCTOR_OPTIONS)]
    if manifest.fp8_max < E4M3FN_MAX and manifest.uses_fp8:
        # trn1/trn2 have no e4m3fn: the compiler reads it as e4m3 (values kept within ±240),
        # inside the one hlo2tensorizer string (docs/neuron.md#fp8-on-trainium)
        layers.append(("fp8", "fp8 on trn1/trn2", (f"{HLO2TENSORIZER}={FP8_AS_E4M3_FLAG}",), {}))
    layers.append(
        ("manifest", "compiler.flags", manifest.compiler.flags, manifest.compiler.inductor)
    )
    layers += [
        (f"rule {i}", f"compiler.per_graph[{i}].flags", rule.flags, rule.inductor)
        for i, rule in enumerate(manifest.compiler.per_graph)
        if spec.matches(rule.match)
    ]
    return layers


def resolve_options(manifest: Manifest, spec: GraphSpec) -> ResolvedOptions:
    options: dict[str, OptionValue] = {}
    origins: dict[str, str] = {}
    raw_flags: list[Flag] = []
    for origin, where, flags, inductor in _layers(manifest, spec):
        for key, value in inductor.items():
            options[key] = value
            origins[key] = origin
        raw_flags += parse_flags(flags, origin, where)
    merged, warnings = merge_flags(raw_flags)
    rendered = [f.render() for f in merged]
    return ResolvedOptions(
        inductor=dict(sorted(options.items())),
        origins=origins,
        flags=tuple(rendered),
        flag_origins={r: f.origin for r, f in zip(rendered, merged, strict=True)},
        warnings=tuple(f"{spec.name}: {w}" for w in warnings),
    )


def neuronx_cc_argv(
    hlo: str, neff: str, neuron_target: str, lnc: int, flags: tuple[str, ...] | list[str]
) -> list[str]:
    """The full neuronx-cc command for one graph: the only place that argv is assembled.

    `flags` are a graph's resolved, rendered flags (ResolvedOptions.flags, or as recorded in a
    lowered bundle's bundle.json). Spelled as the Neuron Compiler CLI Reference Guide documents
    them (`--logical-nc-config`, not the `--lnc` some examples use; see
    tests/golden/neuronx_cc_reference.json, which the golden argv files are checked against).
    """
    return [
        "neuronx-cc",
        "compile",
        hlo,
        "--framework",
        "XLA",
        "--target",
        neuron_target,
        LNC_FLAG,
        str(lnc),
        "--output",
        neff,
        *flags,
    ]
