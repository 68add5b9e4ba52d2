"""`neffkit inspect`: a bundle's summary and graph table, as data (--json) and as rich tables."""

from __future__ import annotations

from typing import Any

from neffkit.bundle import Bundle

INSPECT_SCHEMA_VERSION = 1


def summarize(bundle: Bundle) -> dict[str, Any]:
    data = bundle.data
    files = data["files"]
    sizes = {rel: (bundle.root / rel).stat().st_size for rel in files}
    graphs = [
        {
            "name": g["name"],
            "phase": g["phase"],
            "buckets": g["buckets"],
            "graph_sha256": g["graph_sha256"],
            "artifact": g["artifact"],
            "artifact_bytes": sizes.get(g["artifact"], 0),
            "io_alias": g["io_alias"],
            "ranks": g["ranks"],
            "options": g.get("options", {}),
            "flags": g.get("flags", []),
        }
        for g in data["graphs"]
    ]
    return {
        "schema": INSPECT_SCHEMA_VERSION,
        "bundle": str(bundle.root),
        "digest": bundle.digest,
        "format": data["format"],
        "versions": data["versions"],
        "target": data["target"],
        "host": data.get("host", {}),
        "model": {
            "name": data["manifest"]["name"],
            "architecture": data["model"]["architecture"],
            "layers": data["model"]["num_layers"],
        },
        "layout": data["layout"],
        "weights": [
            {"rank": w["rank"], "file": w["file"], "bytes": sizes.get(w["file"], 0)}
            for w in data["weights"]
        ],
        "total_bytes": sum(sizes.values()),
        "graphs": graphs,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def render(summary: dict[str, Any]) -> Any:
    """A rich renderable: summary table, then the graph table."""
    from rich.console import Group
    from rich.table import Table

    head = Table(show_header=False, box=None)
    lay = summary["layout"]
    rows = [
        ("bundle", summary["bundle"]),
        ("versions", ", ".join(f"{k} {v}" for k, v in summary["versions"].items())),
        ("target", summary["target"]),
        (
            "model",
            f"{summary['model']['name']} ({summary['model']['architecture']}, "
            f"{summary['model']['layers']} layers)",
        ),
        (
            "layout",
            f"tp={lay['tp']} ep={lay['ep']} dtype={lay['dtype']} "
            f"kv={lay['num_blocks']}x{lay['block_size']} tokens",
        ),
        ("buckets", ", ".join(f"{k} {v}" for k, v in lay["buckets"].items())),
        ("weights", ", ".join(f"rank{w['rank']} {_mib(w['bytes'])}" for w in summary["weights"])),
        ("total", _mib(summary["total_bytes"])),
    ]
    for key, value in rows:
        head.add_row(key, value)
    table = Table(title="graphs")
    for col in ("graph", "phase", "rows", "tokens", "context", "io-alias", "artifact", "sha256"):
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
            _mib(g["artifact_bytes"]),
            g["graph_sha256"][:12],
        )
    return Group(head, table)
