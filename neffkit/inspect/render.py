"""Tables a person reads: the bundle summary, findings, one graph, a diff (rich renderables)."""

from __future__ import annotations

import json
from typing import Any

from neffkit.inspect.quant import quant_line, quant_tables


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


def _task_line(lay: dict[str, Any]) -> tuple[str, str]:
    """What the graphs return: sampled tokens, or an embed bundle's pooled states."""
    pooled = lay.get("pooling")
    if pooled:
        scaled = ", normalized" if pooled["normalize"] else ""
        return ("embedding", f"{pooled['pooling']} pooling, {pooled['width']} values{scaled}")
    return (
        "sampling",
        f"whole vocabulary; top-k/top-p among the {lay['max_top_k']} most likely tokens; "
        f"logprobs up to {lay.get('max_logprobs', 0)}"
        + (", prompt logprobs" if lay.get("prompt_logprobs") else ""),
    )


def _kv_line(kv: dict[str, Any]) -> str:
    line = (
        f"{kv['kind']} {kv['dtype']}: {kv['values_per_token_per_layer']} values per token per "
        f"layer, {kv['bytes_per_token']} bytes per token"
    )
    if "mha_equivalent_bytes_per_token" in kv:
        mha = kv["mha_equivalent_bytes_per_token"]
        line += f" (per-head K/V: {mha}, {mha / kv['bytes_per_token']:.1f}x more)"
    return line


def _group_line(group: dict[str, Any]) -> str:
    """One KV group: its layers, what they keep, its pool."""
    window = group["window"]
    keeps = "every position" if window is None else f"a window of {window}"
    return (
        f"layers {_spans(group['layers'])}: {keeps}, {group['num_blocks']} blocks, at most "
        f"{group['blocks_per_seq']} a sequence, {_mib(group['bytes'])}"
    )


def _spans(layers: list[int]) -> str:
    """0-3, 5, 7-9."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _speculation_line(spec: dict[str, Any]) -> str:
    source = (
        f"the draft model's bundle in {spec['draft']}/: neffkit inspect BUNDLE/{spec['draft']}"
        if spec.get("draft")
        else f"prompt lookup {spec['prompt_lookup_min']}-{spec['prompt_lookup_max']} tokens"
    )
    return (
        f"speculation {spec['method']}: {spec['num_tokens']} draft tokens a row, verify graphs "
        f"up to {spec['max_batch']} rows ({source})"
    )


def _fp8_line(fp8: dict[str, Any]) -> str:
    parts = []
    if fp8["weights"]:
        block = "x".join(str(b or "all") for b in fp8["weight_block"])
        part = f"weights per {fp8['weights']} ({block})"
        if fp8["weight_rescale"] != 1.0:
            part += f", x{fp8['weight_rescale']:.4g} at build (scales x{fp8['scale_rescale']:.4g})"
        parts.append(part)
    if fp8["kv_cache"]:
        keys = f"; keys {fp8['keys']}" if fp8.get("keys") else ""
        parts.append(f"kv cache (scales: {fp8['kv_scales']}{keys})")
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
            f"{summary['model']['layers']} layers"
            + (f", revision {rev}" if (rev := summary["model"].get("revision")) else "")
            + ")",
        ),
        (
            "layout",
            f"tp={lay['tp']} ep={lay['ep']} dtype={lay['dtype']} "
            f"kv={lay['num_blocks']}x{lay['block_size']} tokens, "
            f"decode state on the {lay.get('decode_state', 'host')}, prefix caching "
            + ("on" if lay.get("prefix_caching", True) else "off"),
        ),
        ("kv cache", _kv_line(summary["kv_cache"])),
        *((f"kv group {i}", _group_line(g)) for i, g in enumerate(summary["kv_cache"]["groups"])),
        *([("fp8", _fp8_line(summary["fp8"]))] if summary.get("fp8") else []),
        *([("quantized", quant_line(q))] if (q := summary.get("quantization")) else []),
        ("buckets", ", ".join(f"{k} {v}" for k, v in lay["buckets"].items())),
        _task_line(lay),
        *([("speculation", _speculation_line(spec))] if (spec := lay.get("speculation")) else []),
        *([("adapters", _adapters_line(lora))] if (lora := lay.get("lora")) else []),
        ("weights", ", ".join(f"rank{w['rank']} {_mib(w['bytes'])}" for w in summary["weights"])),
        ("total", _mib(summary["total_bytes"])),
        (
            "audit",
            f"{counts['error']} error(s), {counts['warning']} warning(s)"
            + (f", waived: {', '.join(summary['waived'])}" if summary["waived"] else ""),
        ),
    ]


def _adapters_line(lora: dict[str, Any]) -> str:
    return (
        f"{lora['max_loras']} LoRA slot(s) of rank up to {lora['max_rank']} on "
        f"{', '.join(lora['modules'])} ({len(lora['targets'])} projections, {lora['dtype']})"
    )


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
    if summary.get("quantization"):
        parts += quant_tables(summary["quantization"])
    if summary["findings"]:
        parts.append(findings_table(summary["findings"]))
    return Group(*parts)


def render_manifest(report: dict[str, Any]) -> Any:
    """What a manifest inspection checked, then its findings or, plainly, that there were none."""
    from rich.console import Group
    from rich.table import Table

    checked, counts = report["checked"], report["finding_counts"]
    head = Table(show_header=False, box=None)
    rows = [
        ("manifest", f"{report['manifest']} (valid)"),
        ("target", report["target"]),
        ("buckets", ", ".join(f"{k} {v}" for k, v in checked["buckets"].items())),
        ("graphs", f"{len(report['graphs'])}: " + ", ".join(g["name"] for g in report["graphs"])),
        ("flags", " ".join(checked["flags"]) or "none"),
        (
            "rules",
            ", ".join(checked["rules"]) + " (flags and buckets; a bundle adds the graph rules)",
        ),
        *([("waived", ", ".join(checked["waived"]))] if checked["waived"] else []),
    ]
    for key, value in rows:
        head.add_row(key, value)
    if not report["findings"]:
        return Group(head, "no findings")
    total = f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"
    return Group(head, findings_table(report["findings"]), total)


def verification_lines(checks: list[dict[str, Any]]) -> str:
    """One line per bundle `--verify` re-hashed: files, bytes, the hash, the result."""
    return "\n".join(
        f"verified {c['bundle']}: {c['files']} files, {c['bytes']:,} bytes, every {c['hash']} "
        f"equal to bundle.json's: {c['result']}"
        for c in checks
    )


def findings_table(findings: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="findings")
    for col in ("rule", "severity", "graph", "message", "at", "fix"):
        table.add_column(col)
    for f in findings:
        sev = f["severity"] + (" (waived)" if f["waived"] else "")
        table.add_row(f["rule"], sev, f["graph"], f["message"], f["at"][:60], f["fix"])
    return table


def render_graph(d: dict) -> Any:
    from rich.console import Group, RenderableType
    from rich.table import Table

    io = Table(title=f"{d['name']} ({d['phase']}, ranks: {d['ranks']})")
    for col in ("input", "shape", "dtype", "aliased by output"):
        io.add_column(col)
    alias = {a["input"]: str(a["output"]) for a in d["io_alias"]}
    for i in d["inputs"]:
        io.add_row(i["name"], str(i["shape"]), i["dtype"], alias.get(i["name"], ""))
    for o in d["outputs"]:
        io.add_row(f"-> {o['name']}", str(o["shape"]), o["dtype"], "")
    flags = Table(title="options and flags")
    flags.add_column("option / flag")
    flags.add_column("origin")
    for k, v in d["options"].items():
        flags.add_row(f"{k}={v}", d["option_origins"].get(k, ""))
    for f in d["flags"]:
        flags.add_row(f["flag"], f["origin"])
    ops = Table(title="ops")
    ops.add_column("op")
    ops.add_column("count")
    for op, n in d["op_histogram"].items():
        ops.add_row(op, str(n))
    parts: list[RenderableType] = [io, flags, ops]
    if d.get("hlo"):
        lines = [f"HLO module {d['hlo']} (sha256 {d['hlo_sha256'][:12]})"]
        pairs = d["hlo_input_output_alias"]
        lines.append(
            f"  input_output_alias: {len(pairs)} pair(s): "
            + ", ".join(f"out {a['output']} ← param {a['parameter']} ({a['input']})" for a in pairs)
        )
        if d.get("compiler"):
            lines.append(
                f"  compiled by {d['compiler']['version']}: {' '.join(d['compiler']['argv'])}"
            )
        header = d.get("neff_header")
        if header:
            lines.append(f"  NEFF header: {json.dumps(header)}")
        if d.get("verify"):
            lines.append(f"  verify: {json.dumps(d['verify'])}")
        parts.append("\n".join(lines))
    if d["collectives"]:
        parts.append("collectives:\n  " + "\n  ".join(d["collectives"]))
    if d["findings"]:
        parts.append(findings_table(d["findings"]))
    return Group(*parts)


def render_diff(d: dict) -> str:
    lines = [f"a: {d['a']}", f"b: {d['b']}"]
    for key in ("graphs_added", "graphs_removed", "weights_changed"):
        if d[key]:
            lines.append(f"{key.replace('_', ' ')}: {', '.join(map(str, d[key]))}")
    for key in ("versions", "layout"):
        for k, (x, y) in d[key].items():
            lines.append(f"{key} {k}: {x} → {y}")
    for g in d["graphs_changed"]:
        parts = []
        if "graph_sha256" in g:
            parts.append(f"graph {g['graph_sha256'][0][:12]} → {g['graph_sha256'][1][:12]}")
        if "flags" in g:
            parts.append(f"flags -{g['flags']['removed']} +{g['flags']['added']}")
        if "options" in g:
            parts.append(f"options {g['options'][0]} → {g['options'][1]}")
        lines.append(f"{g['graph']}: " + "; ".join(parts))
    if len(lines) == 2:
        lines.append("no differences")
    return "\n".join(lines)
