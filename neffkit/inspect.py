"""`neffkit inspect`: audit what a team ships. Summary, graph table, one graph in detail, hazard
findings, bundle diff, and the manifest-only rules, as data (--json, versioned schema) and tables.

The hazard rules are re-run on the bundle's own canonical graph text (ir/), so a newer neffkit
audits an older bundle with its newer rules; waivers recorded at build time still apply.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from neffkit.bundle import Bundle, BundleRecord, GraphRecord, read_zst_text
from neffkit.compile.audit import (
    COLLECTIVES,
    Finding,
    GraphFacts,
    audit_buckets,
    audit_graph,
    blocking,
    parse_canonical,
)
from neffkit.compile.cache import changed_keys
from neffkit.neff import NeffError, read_header

INSPECT_SCHEMA_VERSION = 1


def _facts(bundle: Bundle, g: GraphRecord) -> GraphFacts:
    record = bundle.record
    neuron = record.neuron.target if record.neuron else None
    text = read_zst_text(bundle.path(g.ir))
    hlo = read_zst_text(bundle.path(g.hlo_text)) if g.hlo_text else None
    return GraphFacts(
        g.name,
        g.phase,
        text,
        g.io_alias,
        g.flags,
        g.flag_origins,
        record.target,
        neuron,
        hlo_text=hlo,
    )


def audit_bundle(bundle: Bundle) -> list[Finding]:
    record = bundle.record
    waive = record.audit.waived
    findings = audit_buckets(record.target, list(record.layout.buckets.prefill), waive)
    for g in record.graphs:
        findings += audit_graph(_facts(bundle, g), waive)
    return findings


def summarize(bundle: Bundle) -> dict[str, Any]:
    record = bundle.record
    files = record.files
    sizes = {
        rel: (bundle.root / rel).stat().st_size for rel in files if (bundle.root / rel).exists()
    }
    findings = audit_bundle(bundle)
    graphs = [_graph_row(bundle, g, sizes, findings) for g in record.graphs]
    counts = Counter(f.severity for f in findings if not f.waived)
    return {
        "schema": INSPECT_SCHEMA_VERSION,
        "bundle": str(bundle.root),
        "digest": bundle.digest,
        "format": record.format,
        "versions": record.versions.to_json(),
        "target": record.target,
        "stage": record.stage or "compiled",
        "neuron": record.neuron.to_json() if record.neuron else None,
        "host": record.host.to_json(),
        "model": {
            "name": record.name,
            "architecture": record.model.architecture,
            "layers": record.model.num_layers,
        },
        "layout": record.layout.to_json(),
        "kv_cache": kv_cache_summary(record),
        "fp8": record.fp8.to_json() if record.fp8 else None,
        "weights": [
            {
                "rank": w.rank,
                "file": w.file,
                "bytes": sizes.get(w.file, 0),
                "sha256": files.get(w.file),
            }
            for w in record.weights
        ],
        "total_bytes": sum(sizes.values()),
        "graphs": graphs,
        "findings": [f.to_json() for f in findings],
        "finding_counts": {s: counts.get(s, 0) for s in ("error", "warning", "info")},
        "waived": list(record.audit.waived),
    }


def _graph_row(
    bundle: Bundle, g: GraphRecord, sizes: dict[str, int], findings: list[Finding]
) -> dict[str, Any]:
    j = g.to_json()
    return {
        "name": g.name,
        "phase": g.phase,
        "buckets": j["buckets"],
        "graph_sha256": g.graph_sha256,
        "artifact": g.artifact,
        "artifact_bytes": sizes.get(g.artifact, 0) if g.artifact else 0,
        "hlo": g.hlo,
        "hlo_sha256": g.hlo_sha256,
        "neff_header": _neff_header(bundle, g),
        "verify": j["verify"],
        "io_alias": j["io_alias"],
        "ranks": j["ranks"],
        "options": j["options"],
        "flags": j["flags"],
        "findings": sum(f.graph == g.name for f in findings),
    }


def _target_line(summary: dict[str, Any]) -> str:
    neuron = summary.get("neuron")
    if not neuron:
        return summary["target"]
    return f"neuron ({neuron['target']}, lnc={neuron['lnc']}), {summary['stage']}"


def _artifact_cell(g: dict[str, Any]) -> str:
    if not g["artifact"]:
        return "HLO only"
    header = g.get("neff_header")
    if header is None:
        return _mib(g["artifact_bytes"])
    if "error" in header:
        return f"bad NEFF: {header['error']}"
    version = f"{header['neff_version_major']}.{header['neff_version_minor']}"
    return (
        f"{_mib(g['artifact_bytes'])} NEFF {version} lnc={header['lnc_size']} "
        f"features={header['feature_bits']}"
    )


def _verify_cell(result: dict[str, Any] | None) -> str:
    if not result:
        return "-"
    if "skipped" in result:
        return "skipped"
    return f"{'ok' if result['ok'] else 'FAIL'} {result['max_kv_error']:.1e}"


def _neff_header(bundle: Bundle, graph: GraphRecord) -> dict[str, Any] | None:
    """The NEFF's own header, read from the file (not the build's record); None if no NEFF."""
    artifact = graph.artifact
    if not artifact or not artifact.endswith(".neff"):
        return None
    try:
        return read_header(bundle.path(artifact)).to_json()
    except (OSError, NeffError) as exc:
        return {"error": str(exc)}


def graph_detail(bundle: Bundle, name: str) -> dict[str, Any]:
    from neffkit.errors import NeffkitError

    g = bundle.record.graph(name)
    if g is None:
        names = ", ".join(x.name for x in bundle.graphs)
        raise NeffkitError(f"--graph: no graph {name!r} in this bundle; graphs: {names}")
    nodes = parse_canonical(read_zst_text(bundle.path(g.ir)))
    ops = Counter(n.target for n in nodes if n.target not in ("input", "output"))
    j = g.to_json()
    return {
        "schema": INSPECT_SCHEMA_VERSION,
        "name": name,
        "phase": g.phase,
        "buckets": j["buckets"],
        "graph_sha256": g.graph_sha256,
        "ranks": j["ranks"],
        "inputs": j["inputs"],
        "outputs": j["outputs"],
        "io_alias": j["io_alias"],
        "options": j["options"],
        "option_origins": j["option_origins"],
        "flags": [{"flag": f, "origin": g.flag_origins.get(f, "")} for f in g.flags],
        "op_histogram": dict(ops.most_common()),
        "collectives": [n.text for n in nodes if n.target.startswith(COLLECTIVES)],
        **_neuron_detail(bundle, g),
        "findings": [
            f.to_json() for f in audit_graph(_facts(bundle, g), bundle.record.audit.waived)
        ],
    }


_HLO_ALIAS = re.compile(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)")


def _neuron_detail(bundle: Bundle, g: GraphRecord) -> dict[str, Any]:
    """neuron graphs: the HLO module's own alias table (what neuronx-cc reads), compiler, NEFF."""
    if not g.hlo or not g.hlo_text:
        return {}
    header = read_zst_text(bundle.path(g.hlo_text)).split("\n", 1)[0]
    names = [i.name for i in g.inputs]
    return {
        "hlo": g.hlo,
        "hlo_sha256": g.hlo_sha256,
        "hlo_input_output_alias": [
            {"output": int(out), "parameter": int(param), "input": names[int(param)]}
            for out, param in _HLO_ALIAS.findall(header)
        ],
        "compiler": g.compiler.to_json() if g.compiler else None,
        "neff_header": _neff_header(bundle, g),
        "verify": g.verify.to_json() if g.verify else None,
    }


def diff_bundles(a: Bundle, b: Bundle) -> dict[str, Any]:
    """What changed from bundle a to bundle b (after a toolchain upgrade, a flag change, ...)."""
    ga = {g.name: g for g in a.graphs}
    gb = {g.name: g for g in b.graphs}
    changed = []
    for name in sorted(set(ga) & set(gb)):
        x, y = ga[name], gb[name]
        entry: dict[str, Any] = {"graph": name}
        if x.graph_sha256 != y.graph_sha256:
            entry["graph_sha256"] = [x.graph_sha256, y.graph_sha256]
        if x.flags != y.flags:
            entry["flags"] = {
                "removed": [f for f in x.flags if f not in y.flags],
                "added": [f for f in y.flags if f not in x.flags],
            }
        ox, oy = x.options, y.options
        if ox != oy:  # only the options that differ, as [in a, in b]
            keys = changed_keys(ox, oy)
            entry["options"] = [
                {k: ox[k] for k in keys if k in ox},
                {k: oy[k] for k in keys if k in oy},
            ]
        if len(entry) > 1:
            changed.append(entry)
    wa = {w.rank: a.record.files.get(w.file) for w in a.record.weights}
    wb = {w.rank: b.record.files.get(w.file) for w in b.record.weights}
    va, vb = a.record.versions.to_json(), b.record.versions.to_json()
    la, lb = a.record.layout.to_json(), b.record.layout.to_json()
    return {
        "schema": INSPECT_SCHEMA_VERSION,
        "a": str(a.root),
        "b": str(b.root),
        "graphs_added": sorted(set(gb) - set(ga)),
        "graphs_removed": sorted(set(ga) - set(gb)),
        "graphs_changed": changed,
        "versions": {k: [va.get(k), vb.get(k)] for k in changed_keys(va, vb)},
        "layout": {k: [la.get(k), lb.get(k)] for k in changed_keys(la, lb)},
        "weights_changed": changed_keys(wa, wb),
    }


def inspect_manifest(path: str) -> dict[str, Any]:
    """The flag and bucket rules on a manifest, before any build (no tracing, no torch)."""
    from neffkit.compile.flags import resolve_options
    from neffkit.compile.plan import make_plan
    from neffkit.manifest import load_manifest

    m = load_manifest(path)
    plan = make_plan(m)
    findings = audit_buckets(m.target, list(m.buckets.prefill), m.audit.waive)
    graphs = []
    for spec in plan.graphs:
        opts = resolve_options(m, spec)
        facts = GraphFacts(
            spec.name,
            spec.phase,
            "",
            (),
            opts.flags,
            opts.flag_origins,
            m.target,
            m.neuron.target if m.neuron else None,
            collectives=m.parallel.tp > 1,
        )  # no graph yet: tp > 1 means collectives
        found = [f for f in audit_graph(facts, m.audit.waive) if f.rule.startswith("NK2")]
        findings += found
        graphs.append(
            {
                "name": spec.name,
                "flags": list(opts.flags),
                "options": opts.inductor,
                "warnings": list(opts.warnings),
            }
        )
    counts = Counter(f.severity for f in findings if not f.waived)
    return {
        "schema": INSPECT_SCHEMA_VERSION,
        "manifest": str(path),
        "target": m.target,
        "graphs": graphs,
        "findings": [f.to_json() for f in findings],
        "finding_counts": {s: counts.get(s, 0) for s in ("error", "warning", "info")},
    }


def kv_cache_summary(record: BundleRecord) -> dict[str, Any]:
    """Cache kind, values and bytes per token (one rank, every layer); for MLA, the bytes a
    per-head K/V cache of the same model would take (what the latent cache saves)."""
    lay, cfg = record.layout, record.model.config
    out: dict[str, Any] = {
        "kind": lay.kv_kind,
        "dtype": lay.cache_dtype,
        "tensors_per_layer": len(lay.kv_names) // lay.num_layers,
        "values_per_token_per_layer": lay.kv_heads_per_rank * lay.head_dim,
        "bytes_per_token": lay.kv_bytes_per_token,
    }
    if lay.kv_kind == "mla":
        heads = int(cfg["num_heads"]) // lay.tp  # type: ignore[call-overload]
        per_head = sum(int(cfg[k]) for k in ("qk_nope_head_dim", "head_dim", "v_head_dim"))  # type: ignore[call-overload]
        out["mha_equivalent_bytes_per_token"] = lay.num_layers * heads * per_head * lay.kv_itemsize
    return out


def exit_status(report: dict[str, Any]) -> int:
    """1 when unwaived errors exist, so CI can gate on `neffkit inspect`."""
    findings = [Finding.from_json(f) for f in report.get("findings", [])]
    return 1 if blocking(findings) else 0


def _kv_line(kv: dict[str, Any]) -> str:
    line = (
        f"{kv['kind']} {kv['dtype']}: {kv['values_per_token_per_layer']} values per token per "
        f"layer, {kv['bytes_per_token']} bytes per token"
    )
    if "mha_equivalent_bytes_per_token" in kv:
        mha = kv["mha_equivalent_bytes_per_token"]
        line += f" (per-head K/V: {mha}, {mha / kv['bytes_per_token']:.1f}x more)"
    return line


def _fp8_line(fp8: dict[str, Any]) -> str:
    parts = []
    if fp8["weights"]:
        block = "x".join(str(b or "all") for b in fp8["weight_block"])
        part = f"weights per {fp8['weights']} ({block})"
        if fp8["weight_rescale"] != 1.0:
            part += f", x{fp8['weight_rescale']:.4g} at build (scales x{fp8['scale_rescale']:.4g})"
        parts.append(part)
    if fp8["kv_cache"]:
        parts.append(f"kv cache (scales: {fp8['kv_scales']})")
    return "; ".join(parts) + f"; values within ±{fp8['max']:g}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    lay = summary["layout"]
    counts = summary["finding_counts"]
    return [
        ("bundle", summary["bundle"]),
        ("versions", ", ".join(f"{k} {v}" for k, v in summary["versions"].items())),
        ("target", _target_line(summary)),
        (
            "model",
            f"{summary['model']['name']} ({summary['model']['architecture']}, "
            f"{summary['model']['layers']} layers)",
        ),
        (
            "layout",
            f"tp={lay['tp']} ep={lay['ep']} dtype={lay['dtype']} "
            f"kv={lay['num_blocks']}x{lay['block_size']} tokens, "
            f"decode state on the {lay.get('decode_state', 'host')}",
        ),
        ("kv cache", _kv_line(summary["kv_cache"])),
        *([("fp8", _fp8_line(summary["fp8"]))] if summary.get("fp8") else []),
        ("buckets", ", ".join(f"{k} {v}" for k, v in lay["buckets"].items())),
        (
            "sampling",
            f"whole vocabulary; top-k/top-p among the {lay['max_top_k']} most likely tokens; "
            f"logprobs up to {lay.get('max_logprobs', 0)}"
            + (", prompt logprobs" if lay.get("prompt_logprobs") else ""),
        ),
        ("weights", ", ".join(f"rank{w['rank']} {_mib(w['bytes'])}" for w in summary["weights"])),
        ("total", _mib(summary["total_bytes"])),
        (
            "audit",
            f"{counts['error']} error(s), {counts['warning']} warning(s)"
            + (f", waived: {', '.join(summary['waived'])}" if summary["waived"] else ""),
        ),
    ]


def render(summary: dict[str, Any]) -> Any:
    """Summary, graph table and findings as rich renderables."""
    from rich.console import Group
    from rich.table import Table

    head = Table(show_header=False, box=None)
    for key, value in _summary_rows(summary):
        head.add_row(key, value)
    table = Table(title="graphs")
    for col in (
        "graph",
        "phase",
        "rows",
        "tokens",
        "context",
        "io-alias",
        "ranks",
        "artifact",
        "sha256",
        "verify",
        "findings",
    ):
        table.add_column(col)
    for g in summary["graphs"]:
        b = g["buckets"]
        table.add_row(
            g["name"],
            g["phase"],
            str(b["rows"]),
            str(b["tokens"]),
            str(b["context"]),
            f"{len(g['io_alias'])} pairs",
            str(g["ranks"]),
            _artifact_cell(g),
            g["graph_sha256"][:12],
            _verify_cell(g.get("verify")),
            str(g["findings"]),
        )
    parts = [head, table]
    if summary["findings"]:
        parts.append(findings_table(summary["findings"]))
    return Group(*parts)


def findings_table(findings: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="findings")
    for col in ("rule", "severity", "graph", "message", "at", "fix"):
        table.add_column(col)
    for f in findings:
        sev = f["severity"] + (" (waived)" if f["waived"] else "")
        table.add_row(f["rule"], sev, f["graph"], f["message"], f["at"][:60], f["fix"])
    return table
