"""Write a random Llama-3.2-1B-shaped bfloat16 checkpoint (1.24B parameters, 2.5 GB) for benchmarks.

Shaped like Llama 3.2 1B (hidden 2048, 16 layers, 32 query / 8 KV heads, intermediate 8192, vocab
128256, tied embeddings, llama3 rope): the size at which build memory and per-rank shard sizes
stop being noise. The tensors are generated and written one at a time (streamed safetensors), so
making it needs about one tensor of memory. Random weights: tokens are meaningless, shapes and
bytes are real. Usage: python tools/make_large_model.py OUT_DIR [--layers 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from neffkit.contract.tensor_files import write_tensors

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 2048, 8192, 128256, 32, 8, 64


def config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rope_theta": 500000.0,
    }


def specs(layers: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    bf16 = torch.bfloat16
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN), bf16)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,), bf16),
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), bf16),
            (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), bf16),
            (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), bf16),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), bf16),
            (p + "post_attention_layernorm.weight", (HIDDEN,), bf16),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN), bf16),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN), bf16),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER), bf16),
        ]
    return out + [("model.norm.weight", (HIDDEN,), bf16)]


def tensors(
    spec_list: list[tuple[str, tuple[int, ...], torch.dtype]], seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for name, shape, dtype in spec_list:
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype)
        else:
            yield name, (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    spec_list = specs(args.layers)
    write_tensors(args.out / "model.safetensors", spec_list, tensors(spec_list, args.seed))
    (args.out / "config.json").write_text(json.dumps(config(args.layers), indent=2) + "\n")
    params = sum(torch.Size(s).numel() for _, s, _ in spec_list)
    print(f"{args.out}: {params / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
