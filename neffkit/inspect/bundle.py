"""A shipped bundle as data: its summary, one graph in detail, the hazard findings re-run on its
own canonical graph text (a newer neffkit audits an older bundle with its newer rules; waivers
recorded at build time still apply), and the diff of two bundles (versioned schema, `--json`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from neffkit.audit.checks import audit_buckets, audit_graph, blocking
from neffkit.audit.graph import COLLECTIVES, GraphFacts, parse_canonical
from neffkit.audit.rules import Finding
from neffkit.compile.cache.keys import changed_keys
from neffkit.contract.bundle import Bundle, read_zst_text
from neffkit.contract.neff import NeffError, read_header
from neffkit.contract.records import BundleRecord, GraphRecord
from neffkit.inspect.quant import quantization_summary
from neffkit.targets import DTYPE_BYTES

INSPECT_SCHEMA_VERSION = 1


def _facts(bundle: Bundle, g: GraphRecord) -> GraphFacts:
    record = bundle.record
    neuron = record.neuron.target if record.neuron else None
    text = read_zst_text(bundle.path(g.ir))
    hlo = read_zst_text(bundle.path(g.hlo_text)) if g.hlo_text else None
    return GraphFacts(
        name=g.name,
        phase=g.phase,
        text=text,
        io_alias=g.io_alias,
        flags=g.flags,
        flag_origins=g.flag_origins,
        target=record.target,
        neuron_target=neuron,
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
            # the commit of a model read from a Hugging Face cache (manifest/hub.py)
            "revision": record.manifest.resolved.get("model_revision"),
        },
        "task": "generate" if record.layout.pooling is None else "embed",
        "layout": record.layout.to_json(),
        "kv_cache": kv_cache_summary(record),
        "fp8": record.fp8.to_json() if record.fp8 else None,
        "quantization": quantization_summary(bundle),
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


def kv_cache_summary(record: BundleRecord) -> dict[str, Any]:
    """Cache kind, values and bytes per token (one rank, every layer); for MLA, the bytes a
    per-head K/V cache of the same model would take (what the latent cache saves)."""
    lay = record.layout
    cfg: dict[str, Any] = record.model.config  # JSON values: the dims below are numbers
    out: dict[str, Any] = {
        "kind": lay.kv_kind,
        "dtype": lay.kv_dtype,
        "tensors_per_layer": len(lay.kv_names) // lay.num_layers,
        "values_per_token_per_layer": lay.kv_heads_per_rank * lay.head_dim,
        "bytes_per_token": lay.kv_bytes_per_token,
    }
    per_layer_block = lay.kv_bytes_per_token // lay.num_layers * lay.block_size
    out["groups"] = [  # contract/kv_groups.py: each group's pool, one rank's bytes of it
        {
            "layers": list(g.layers),
            "window": g.window,
            "num_blocks": g.num_blocks,
            "blocks_per_seq": g.blocks_per_seq,
            "bytes": g.num_blocks * per_layer_block * len(g.layers),
        }
        for g in lay.groups
    ]
    if lay.kv_kind == "mla":
        heads = int(cfg["num_heads"]) // lay.tp
        per_head = sum(int(cfg[k]) for k in ("qk_nope_head_dim", "head_dim", "v_head_dim"))
        out["mha_equivalent_bytes_per_token"] = (
            lay.num_layers * heads * per_head * DTYPE_BYTES[lay.kv_dtype]
        )
    return out


def verification(bundle: Bundle) -> dict[str, Any]:
    """What `--verify` re-hashed (read_bundle already raised on any mismatch): said, so a
    silent success is not mistaken for a check that did not run."""
    files = bundle.record.files
    return {
        "bundle": str(bundle.root),
        "files": len(files),
        "bytes": sum((bundle.root / rel).stat().st_size for rel in files),
        "hash": "sha256",
        "result": "ok",
    }


def exit_status(report: dict[str, Any]) -> int:
    """1 when unwaived errors exist, so CI can gate on `neffkit inspect`."""
    findings = [Finding.from_json(f) for f in report.get("findings", [])]
    return 1 if blocking(findings) else 0
