"""Write the tiny random checkpoints the family manifests build (manifests/tiny-*.yaml).

One per family or rope type the demo model does not cover: Llama with Llama 3.1's `llama3` rope,
Qwen2.5-style `yarn`, GPT-OSS (sinks, sliding/full layers, biases, clamped SwiGLU, yarn),
DeepSeek-V3 (MLA with q-LoRA, group-limited routing, a shared expert, a dense first layer). Random
weights (biases too), stored bfloat16, HF format via `save_pretrained`, the demo tokenizer (so
text prompts work). Deterministic for a seed. Usage: python tools/make_tiny_models.py [--out models]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo-llama"
COMMON: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.1,
    eos_token_id=0,
    bos_token_id=None,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            }
        },
    ),
    "tiny-qwen2-yarn": (
        "Qwen2Config",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1000000.0,
            }
        },
    ),
    "tiny-gpt-oss": (
        "GptOssConfig",
        {
            "intermediate_size": 64,
            "head_dim": 32,
            "num_local_experts": 16,
            "num_experts_per_tok": 2,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        },
    ),
    "tiny-deepseek-v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "moe_intermediate_size": 64,
            "q_lora_rank": 64,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "n_routed_experts": 16,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 40.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        },
    ),
}


def make(name: str, out: Path, seed: int) -> None:
    config_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF initialises biases to zero; random ones exercise them
        for param_name, param in [*model.named_parameters(), *model.named_buffers()]:
            if "bias" in param_name and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(out)  # half the bytes in git; builds cast up
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO / file).exists():
            shutil.copyfile(DEMO / file, out / file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "models")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in FAMILIES:
        make(name, args.out / name, args.seed)
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
