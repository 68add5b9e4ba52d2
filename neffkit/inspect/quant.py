"""A bundle's quantized weights as stored: one row per graph weight (its codes, scales, zero
points or minimums and high-bit planes joined), the same by scheme, and the totals against the
float32 bytes those weights would take.

Read from bundle.json alone (the model record's `weight_quant`: graph weight → scheme id, and
the checkpoint's `weight_format`; the manifest's `quantization`) and the weight files' headers:
no torch, no model code. The scheme id is kernels/intquant.QuantScheme.to_id's spelling.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

from neffkit.contract.bundle import Bundle

# a weight's stored parts beside its codes `<w>` (kernels/intquant.py)
PARTS = {".qscale": "scale_bytes", ".qzero": "aux_bytes", ".qmin": "aux_bytes"}
HIGH = ".qhigh"
FLOAT32 = 4
ROWS_SHOWN = 24  # more quantized weights than this: the tables show one row per scheme only
PART_COLUMNS = (
    ("codes_bytes", "codes"),
    ("scale_bytes", "scales"),
    ("aux_bytes", "zeros/mins"),
    ("high_bytes", "high bits"),
)


def parse_scheme(scheme_id: str) -> dict[str, Any]:
    """`sym:b4:g32:z8`, `e2m1:b4:g32`, `sym:b8:g0:z128:a:int8-token` → its fields."""
    head, _, activations = scheme_id.partition(":a:")
    kind, *rest = head.split(":")
    fields: dict[str, Any] = {"kind": kind, "bits": 0, "group": 0, "zero": 0}
    for part in rest:
        fields[{"b": "bits", "g": "group", "z": "zero"}[part[0]]] = int(part[1:])
    return {**fields, "activations": activations}


def describe(s: dict[str, Any]) -> str:
    """A scheme in words: `int4 sym (zero 8), groups of 32`."""
    kind = {"sym": f"sym (zero {s['zero']})", "zero": "zero points", "min": "minimums"}
    name = "fp4 e2m1" if s["kind"] == "e2m1" else f"int{s['bits']} {kind[s['kind']]}"
    group = f"groups of {s['group']}" if s["group"] else "per output channel"
    acts = {
        "int8-token": ", int8 activations per token",
        "int8-block": ", int8 activations per block of 32",
    }.get(s["activations"], "")
    return f"{name}, {group}{acts}"


def shard_header(path: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's header (name → dtype, shape, data_offsets), read without torch."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, dict[str, Any]] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _nbytes(entry: dict[str, Any]) -> int:
    start, end = entry["data_offsets"]
    return int(end - start)


def weight_row(
    name: str, scheme_id: str, headers: list[dict[str, dict[str, Any]]]
) -> dict[str, Any]:
    """One weight: its bytes over every rank's file, its shape on one rank ([..., out, in])."""
    s = parse_scheme(scheme_id)
    row: dict[str, Any] = {"name": name, "scheme": scheme_id, **s, "description": describe(s)}
    codes = headers[0][name]["shape"]
    per_byte = 1 if s["bits"] == 8 else 2  # below 8 bits the codes are a nibble plane
    row["shape"] = [*codes[:-1], codes[-1] * per_byte]
    sizes = dict.fromkeys(("codes_bytes", "scale_bytes", "aux_bytes", "high_bytes"), 0)
    values = 0
    for header in headers:
        sizes["codes_bytes"] += _nbytes(header[name])
        for suffix, key in (*PARTS.items(), (HIGH, "high_bytes")):
            if name + suffix in header:
                sizes[key] += _nbytes(header[name + suffix])
        count = 1
        for dim in header[name]["shape"]:
            count *= dim
        values += count * per_byte
    row.update(sizes)
    row["bytes"] = sum(sizes.values())
    row["float32_bytes"] = values * FLOAT32
    row["bits_per_weight"] = round(row["bytes"] * 8 / values, 3)
    return row


def _source(bundle: Bundle) -> dict[str, Any]:
    """Where the quantization came from: the checkpoint's format (with the manifest's
    `quantization.activations`, where given), or the manifest's."""
    cfg: dict[str, Any] = bundle.record.model.config
    manifest = bundle.record.manifest.resolved.get("quantization") or {}
    if cfg.get("weight_format"):
        options = {str(k): v for k, v in cfg.get("weight_format_options") or []}
        source = {"from": "checkpoint", "format": cfg["weight_format"], "options": options}
        return {**source, "manifest": dict(manifest)} if manifest else source  # type: ignore[arg-type]
    return {"from": "manifest", "format": "manifest", "options": dict(manifest)}  # type: ignore[arg-type]


def quantization_summary(bundle: Bundle) -> dict[str, Any] | None:
    """The `quantization` section of `inspect --json` (None: no quantized weights)."""
    cfg: dict[str, Any] = bundle.record.model.config
    pairs: list[list[str]] = cfg.get("weight_quant") or []  # [graph weight, scheme id]
    if not pairs:
        return None
    headers = [shard_header(bundle.path(w.file)) for w in bundle.record.weights]
    rows = [weight_row(name, sid, headers) for name, sid in pairs]
    by_scheme: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_scheme[row["scheme"]].append(row)
    return {
        **_source(bundle),
        "ranks": len(headers),
        "weights": rows,
        "schemes": [
            {"scheme": sid, "description": group[0]["description"], **_totals(group)}
            for sid, group in sorted(by_scheme.items())
        ],
        "totals": _totals(rows),
    }


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    stored = sum(r["bytes"] for r in rows)
    wide = sum(r["float32_bytes"] for r in rows)
    return {
        "weights": len(rows),
        "bytes": stored,
        "float32_bytes": wide,
        "bits_per_weight": round(stored * 8 * FLOAT32 / wide, 3) if wide else 0.0,
    }


def size(n: int) -> str:
    """Bytes for a person: B, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def quant_line(q: dict[str, Any]) -> str:
    """The summary's one line: source, weights, bytes stored against float32."""
    t = q["totals"]
    source = q["format"]
    if q["from"] == "manifest":
        opts = q["options"]
        source = f"manifest {opts.get('weights')}" + (
            f" (group {opts['group_size']})" if opts.get("group_size") else ""
        )
    ranks = f" over {q['ranks']} ranks" if q["ranks"] > 1 else ""
    return (
        f"{source}: {t['weights']} weights, {size(t['bytes'])} stored{ranks} "
        f"({t['bits_per_weight']:g} bits a weight), {size(t['float32_bytes'])} as float32 "
        f"({t['float32_bytes'] / t['bytes']:.1f}x)"
    )


def quant_tables(q: dict[str, Any]) -> list[Any]:
    """Rich tables: one row per scheme with the totals, and for a few weights (up to
    ROWS_SHOWN) one row per weight with its parts' bytes."""
    from rich.table import Table

    schemes = Table(title="quantized weights by scheme")
    for col in ("scheme", "format", "weights", "bytes", "as float32", "bits/weight"):
        schemes.add_column(col)
    t = q["totals"]
    for row in (*q["schemes"], {"scheme": "total", "description": "", **t}):
        schemes.add_row(
            row["scheme"],
            row["description"],
            str(row["weights"]),
            size(row["bytes"]),
            size(row["float32_bytes"]),
            f"{row['bits_per_weight']:g}",
        )
    if len(q["weights"]) > ROWS_SHOWN:
        return [schemes]
    parts = [(k, c) for k, c in PART_COLUMNS if any(r[k] for r in q["weights"])]
    weights = Table(title="quantized weights")
    for col in ("weight", "scheme", "shape", *(c for _, c in parts), "bytes", "bits/weight"):
        weights.add_column(col)
    for r in q["weights"]:
        weights.add_row(
            r["name"],
            r["scheme"],
            "x".join(map(str, r["shape"])),
            *(size(r[k]) for k, _ in parts),
            size(r["bytes"]),
            f"{r['bits_per_weight']:g}",
        )
    return [schemes, weights]
