"""GGUF files for the tests, written with gguf-py's GGUFWriter: random valid blocks of every type
neffkit keeps quantized, and a tiny random Llama (llama metadata, the demo model's byte-level BPE
tokenizer as GGUF's gpt2 tokenizer, a chat template) mixing quantized types over its tensors.

gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 from floats; it cannot write K-quants, so
those blocks are random bytes with f16 `d` / `dmin` set to sane magnitudes (every code, 6-bit
sub-scale and minimum pattern is then valid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.models import CHAT_TEMPLATE, DEMO_MODEL

FLOATS = {"F32": np.float32, "F16": np.float16}
# the types gguf-py quantizes from floats
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# where each K-quant block keeps its f16 d (and dmin), and the magnitude each gets
K_SCALES = {"Q4_K": (0, 2, 4e-4, 3e-3), "Q5_K": (0, 2, 2e-4, 1.5e-3), "Q6_K": (208, None, 2e-4, 0)}

TINY = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=1024, context=256)
# the tiny Llama's tensor types: every kept type, K-quants on each kind of projection, both
# column- (q, k, v, gate, up) and row-parallel (o, down) cuts of a K-quant at tp=2
TINY_TYPES = {
    "token_embd": "Q6_K",
    "output": "Q8_0",
    "output_norm": "F16",
    "blk.0.attn_q": "Q4_K",
    "blk.0.attn_k": "Q4_K",
    "blk.0.attn_v": "Q6_K",
    "blk.0.attn_output": "Q4_1",
    "blk.0.ffn_gate": "Q4_K",
    "blk.0.ffn_up": "Q5_K",
    "blk.0.ffn_down": "Q6_K",
    "blk.1.attn_q": "Q8_0",
    "blk.1.attn_k": "Q5_0",
    "blk.1.attn_v": "Q5_1",
    "blk.1.attn_output": "Q4_K",
    "blk.1.ffn_gate": "Q4_0",
    "blk.1.ffn_up": "Q4_K",
    "blk.1.ffn_down": "Q4_K",
}


def random_blocks(
    rng: np.random.Generator, kind: str, shape: tuple[int, ...], from_floats: bool = True
) -> np.ndarray:
    """Valid blocks of `kind` for a tensor of `shape` [..., cols] (uint8 [..., bytes]): legacy
    types quantized by gguf-py from random floats (or, `from_floats` False, random bytes with a
    sane f16 d), K-quants random bytes with sane f16 d / dmin."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    if kind in LEGACY and from_floats:
        return gguf.quantize((rng.standard_normal(shape) * 0.2).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, (*lead, cols // block, size), dtype=np.uint8)
    d_at, dmin_at, d_mag, dmin_mag = K_SCALES.get(kind, (0, 2, 2e-2, 2e-2))
    n = blocks.shape[:-1]
    d = (rng.uniform(0.25, 1.0, n) * d_mag).astype(np.float16).view(np.uint8)
    blocks[..., d_at : d_at + 2] = d.reshape(*n, 2)
    if dmin_at is not None and kind not in ("Q4_0", "Q5_0", "Q8_0"):
        dmin = (rng.uniform(-1.0, 1.0, n) * dmin_mag).astype(np.float16).view(np.uint8)
        blocks[..., dmin_at : dmin_at + 2] = dmin.reshape(*n, 2)
    return blocks.reshape(*lead, -1)


def _tokenizer(w: Any) -> None:
    """The demo model's byte-level BPE (1024 tokens, its merges) as GGUF's gpt2 tokenizer."""
    spec = json.loads((DEMO_MODEL / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def head_dim() -> int:
    return TINY["hidden"] // TINY["heads"]


def _shapes() -> dict[str, tuple[int, ...]]:
    h, i, kv = TINY["hidden"], TINY["intermediate"], TINY["kv_heads"] * head_dim()
    out: dict[str, tuple[int, ...]] = {
        "token_embd": (TINY["vocab"], h),
        "output": (TINY["vocab"], h),
        "output_norm": (h,),
    }
    for layer in range(TINY["layers"]):
        b = f"blk.{layer}"
        out |= {f"{b}.attn_norm": (h,), f"{b}.ffn_norm": (h,)}
        out |= {f"{b}.attn_q": (h, h), f"{b}.attn_k": (kv, h), f"{b}.attn_v": (kv, h)}
        out |= {f"{b}.attn_output": (h, h), f"{b}.ffn_gate": (i, h), f"{b}.ffn_up": (i, h)}
        out[f"{b}.ffn_down"] = (h, i)
    return out


def write_tiny_llama(
    path: Path, types: dict[str, str] | None = None, seed: int = 0, name: str = "tiny-llama"
) -> Path:
    """The tiny random Llama as a GGUF file at `path` (deterministic: same seed, same bytes);
    `types` overrides TINY_TYPES (tensors not named are F32: the norms)."""
    import gguf

    types = {**TINY_TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(TINY["context"])
    w.add_embedding_length(TINY["hidden"])
    w.add_block_count(TINY["layers"])
    w.add_feed_forward_length(TINY["intermediate"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_dimension_count(head_dim())
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(TINY["vocab"])
    _tokenizer(w)
    for base, shape in _shapes().items():
        kind = types.get(base, "F32")
        if kind in ("F32", "F16"):
            values = rng.standard_normal(shape) * (0.1 if len(shape) == 1 else 0.2)
            values += 1.0 if len(shape) == 1 else 0.0  # norms around 1
            w.add_tensor(f"{base}.weight", values.astype(FLOATS[kind]))
        else:
            blocks = random_blocks(rng, kind, shape)
            w.add_tensor(f"{base}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
