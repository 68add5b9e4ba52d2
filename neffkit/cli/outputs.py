"""How `neffkit run` prints an offline output where a person reads it (`--json`: whole)."""

from __future__ import annotations

from typing import Any


def shown(out: dict[str, Any]) -> str:
    """One output as a person reads it: the text (ids without a tokenizer); an embedding's
    width, norm and first values (`--json` prints it whole)."""
    if "embedding" in out:
        vector = out["embedding"]
        norm = sum(v * v for v in vector) ** 0.5
        head = ", ".join(f"{v:.4f}" for v in vector[:4])
        size = f"{len(vector)} values, norm {norm:.4f}"
        return f"embedding of {out['prompt_tokens']} tokens: {size}: [{head}, ...]"
    return out["text"] if out["text"] is not None else ",".join(map(str, out["token_ids"]))
