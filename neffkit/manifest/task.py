"""`task:` what the bundle's graphs compute. `generate` (the default): prefill, decode and verify
graphs that sample tokens. `embed`: prefill graphs only, each returning its sequences' pooled
final hidden states (no LM head, no sampling, no decode buckets), served on /v1/embeddings, as
vLLM's `--task embed` (vllm-neuron's `--convert embed`).

`embedding:` says how a sequence's states become one vector: `pooling` last (the last token's:
Qwen3-Embedding, e5-mistral), mean (over every token) or cls (the first token's), and
`normalize` (to unit length, as sentence-transformers' Normalize; cosine similarity is then a dot
product). What only generation reads (decode buckets, sampling, speculation, adapters, the LM
head's dtype, the decode state) is refused in an embed manifest, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neffkit.errors import ManifestError
from neffkit.manifest.fields import choice, mapping, no_unknown

TASKS = ("generate", "embed")
POOLINGS = ("last", "mean", "cls")
# top-level sections only generation reads
GENERATE_ONLY = ("sampling", "speculation", "lora", "lm_head", "decode_state")


@dataclass(frozen=True)
class Embedding:
    """How an embed bundle pools and scales a sequence's final hidden states."""

    pooling: str = "last"
    normalize: bool = True


def read_task(data: dict[str, Any]) -> Embedding | None:
    """The manifest's task: None for generate; for embed its `embedding` section, after
    refusing every section and bucket list only generation reads."""
    task = choice(data.get("task", "generate"), TASKS, "task")
    if task == "generate":
        if "embedding" in data:
            raise ManifestError(
                "embedding: only an embed manifest pools hidden states", hint="add task: embed"
            )
        return None
    for key in GENERATE_ONLY:
        if key in data:
            raise ManifestError(
                f"{key}: an embed bundle generates no tokens; this section applies to task "
                "generate only",
                hint=f"remove {key}",
            )
    buckets = data.get("buckets")
    if isinstance(buckets, dict) and "decode" in buckets:
        raise ManifestError(
            "buckets.decode: an embed bundle has prefill graphs only (no decode steps)",
            hint="remove buckets.decode",
        )
    kv = data.get("kv_cache")
    if isinstance(kv, dict) and kv.get("prefix_caching") is True:
        raise ManifestError(
            "kv_cache.prefix_caching: an embedding pools the states of every token, which "
            "blocks cached by another request do not carry; an embed bundle has no prefix cache",
            hint="remove kv_cache.prefix_caching",
        )
    raw = mapping(data.get("embedding", {}), "embedding")
    no_unknown(raw, ("pooling", "normalize"), "embedding")
    normalize = raw.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ManifestError(f"embedding.normalize: expected true or false, got {normalize!r}")
    return Embedding(choice(raw.get("pooling", "last"), POOLINGS, "embedding.pooling"), normalize)
