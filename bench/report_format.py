"""What every section of the performance page is written with (bench/report.py and the
report_*.py modules that write its sections): a Markdown table, the CPU a result was measured on,
a bundle's path as the page shows it. Shared, so that every section's tables and names read
alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu(d: dict[str, Any]) -> str:
    m = d.get("machine", {})
    return f"{m.get('cpu', '?')}, {m.get('threads', '?')} threads"


def bundle_name(path: str) -> str:
    """A repository-relative bundle path as written; an absolute one by its directory name."""
    return Path(path).name if Path(path).is_absolute() else path


# the columns every llama.cpp comparison starts with (after the weights' name)
PEER_COLUMNS = [
    "b1 ms neffkit",
    "b1 ms llama.cpp",
    "b1 relative",
    "b8 tok/s neffkit",
    "b8 tok/s llama.cpp",
    "b8 relative",
]
