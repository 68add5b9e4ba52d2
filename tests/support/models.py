"""The oracle's checkpoints: tiny random HF models of every family (MODELS), made once per
machine into the test cache, the shared prompts, and test manifests over them."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from neffkit.platform import cpu_kernels
from tests.support import REPO

# The oracle is transformers' own PyTorch code. From 5.25 on, from_pretrained swaps layers for
# kernels from the Hub unless told not to, and such a model is no longer the reference.
os.environ.setdefault("USE_HUB_KERNELS", "NO")

DEMO_MODEL = REPO / "models" / "demo-llama"
VOCAB = 1024  # matches the demo tokenizer, so test models can take text prompts

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
)

# the test checkpoints' chat template (transformers >= 4.43 saves it as chat_template.jinja)
CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant: {% endif %}"
)

# kind → (transformers config class, extra config, buckets)
SMALL = {"prefill": [16], "decode": [4], "context": [64]}  # two graphs: one prefill, one decode
# decode [1, 4]: rows move into a smaller bucket (runtime tests)
TWO_DECODE = {"prefill": [16], "decode": [1, 4], "context": [64]}
# MoE: decode [1] gathers each token's 2 routed experts (2 < 8); prefill runs all 8 densely, the
# code a decode of 4 rows would run too (8 is not < 8); more prompts than rows take turns
ONE_DECODE = {"prefill": [16], "decode": [1], "context": [64]}
DEEPSEEK: dict[str, Any] = {
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    },
}
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, list[int]]]] = {
    # prefill_batch [1, 4]: prompts given together prefill packed, one row each (a context
    # bucket switch: the lowered llama bundle's [32, 64], test_generate)
    "llama": (
        "LlamaConfig",
        {},
        {"prefill": [16], "decode": [1, 4], "context": [64], "prefill_batch": [1, 4]},
    ),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}, TWO_DECODE),
    # GELU (exact erf) and every bias: hidden_act and attention/mlp_bias change the function
    "llama_gelu": (
        "LlamaConfig",
        {"hidden_act": "gelu", "attention_bias": True, "mlp_bias": True},
        SMALL,
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, SMALL),
    "mistral": ("MistralConfig", {"sliding_window": 24}, SMALL),
    # MQA + qkv bias; a vocabulary tp=2 does not divide: the last vocab shard is padded
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 1, "vocab_size": 1027}, SMALL),
    # layer 0 dense, layer 1 sparse; renormalised top-2 of 8 experts (buckets: ONE_DECODE)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
        },
        ONE_DECODE,
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}, ONE_DECODE),
    # rope scaling: frequencies are a graph input, so llama3/linear reuse llama's graphs (cache
    # hits) and only yarn (its attention factor scales cos/sin) compiles its own. The scaled
    # frequencies act well inside the test prompts' positions (original length 32 < 49).
    "llama_rope3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        },
        SMALL,
    ),
    "llama_linear": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        SMALL,
    ),
    "qwen2_yarn": (
        "Qwen2Config",
        {
            "num_key_value_heads": 1,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        },
        SMALL,
    ),
    # GPT-OSS: sinks, sliding (window 8 < the test prompts) and full layers, biases, clamped
    # SwiGLU over interleaved gate/up, top-2 of 8 experts, yarn rope as the release has it
    "gpt_oss": (
        "GptOssConfig",
        {
            "intermediate_size": 32,
            "head_dim": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        },
        ONE_DECODE,
    ),
    # DeepSeek-V3: MLA (q-LoRA, latent cache, interleaved rope, yarn with mscale_all_dim),
    # a dense first layer, then sigmoid group-limited routing (2 of 4 groups), top-2 of 8
    # experts, a shared expert; decode b1 gathers its routed experts
    "deepseek": ("DeepseekV3Config", DEEPSEEK, ONE_DECODE),
    "deepseek_noq": ("DeepseekV3Config", {**DEEPSEEK, "q_lora_rank": None}, SMALL),
    # Gemma 3: a sliding (window 8) and a full layer with their own rope (default / linear),
    # q/k norms, four norms a layer, sqrt(hidden) embedding scale, query_pre_attn_scalar
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
        SMALL,
    ),
    # Phi-3: fused qkv_proj and gate_up_proj; longrope (short factors: context <= original 64)
    "phi3": (
        "Phi3Config",
        {
            "pad_token_id": 0,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
        },
        SMALL,
    ),
    # Granite: embedding, attention, residual and logit multipliers
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.05,
            "residual_multiplier": 0.22,
            "logits_scaling": 8.0,
        },
        SMALL,
    ),
    # OLMo: weightless LayerNorms and clip_qkv; OLMo 2: norms after, q/k norms over all heads
    "olmo": ("OlmoConfig", {"clip_qkv": 0.5, "pad_token_id": 0}, SMALL),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}, SMALL),
    # Cohere: parallel attention and MLP, LayerNorms, interleaved rope, per-head q/k norms
    "cohere": ("CohereConfig", {"use_qk_norm": True, "logit_scale": 0.5, "pad_token_id": 0}, SMALL),
    # Gemma 2: soft-capped attention scores and logits (caps small enough to bite)
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
        SMALL,
    ),
    # Llama 4: a chunked (8 tokens < the test prompts) RoPE layer with L2 q/k norms and a dense
    # MLP, then a NoPE full layer (temperature-tuned from position 3: floor_scale 4) with top-1
    # sigmoid-routed experts scaling their inputs and a shared expert (buckets: ONE_DECODE)
    "llama4": (
        "Llama4TextConfig",
        {
            "intermediate_size": 32,
            "intermediate_size_mlp": 128,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,
            "no_rope_layers": [1, 0],
            "attention_chunk_size": 8,
            "floor_scale": 4,
            "attn_scale": 0.1,
            "pad_token_id": None,
        },
        ONE_DECODE,
    ),
}
# kind → manifest fields beyond buckets. llama_tied runs the runtime tests whose rows move
# between sequences and buckets: there, decode reads its tokens from the device state
# (decode_state: device; the other cpu bundles send them from the host, the cpu default), and
# every decode projection goes through neffkit's C++ kernel (cpu_kernel: on; auto leaves the
# test models' small weights to Inductor).
EXTRA: dict[str, dict[str, Any]] = {
    "llama_tied": {
        "decode_state": "device",
        "compiler": {"cpu_kernel": "on" if cpu_kernels.supported() else "off"},
    },
    # qwen3 is the CI-shard test's byte-identity reference, so its graphs call none of
    # neffkit's C++ ops: Inductor's code for a graph that calls one differed between an
    # in-process build and a CLI one (the same traced graph, a different fusion), which is not
    # solved yet
    "qwen3": {"compiler": {"cpu_kernel": "off"}},
}
# kind → (parallel layout, buckets) of the tp > 1 bundles
PARALLEL: dict[str, tuple[dict[str, int], dict[str, list[int]]]] = {
    "llama": ({"tp": 2}, {"prefill": [16], "decode": [4], "context": [256]}),
    "qwen3": ({"tp": 2}, SMALL),
    "qwen2": ({"tp": 2}, SMALL),  # one KV head: replicated on both ranks
    "qwen3_moe": ({"tp": 2, "ep": 2}, SMALL),
    # ep=2: 4 experts a rank; decode b1 gathers among them, the other rank's slots weigh 0
    "mixtral": ({"tp": 2, "ep": 2}, TWO_DECODE),
    "gpt_oss": ({"tp": 2, "ep": 2}, TWO_DECODE),
    "deepseek": ({"tp": 2, "ep": 2}, TWO_DECODE),
    "deepseek_noq": ({"tp": 2, "ep": 2}, SMALL),  # q_proj's heads split over the ranks
    "phi3": ({"tp": 2}, SMALL),
    "granite": ({"tp": 2}, SMALL),
    "olmo": ({"tp": 2}, SMALL),
    "olmo2": ({"tp": 2}, SMALL),
    "cohere": ({"tp": 2}, SMALL),
    "gemma3": ({"tp": 2}, SMALL),
    "gemma2": ({"tp": 2}, SMALL),
    # ep=2: two experts a rank, each whole; the shared expert and dense MLP split over tp
    "llama4": ({"tp": 2, "ep": 2}, TWO_DECODE),
}


# The shared test prompts (token ids below the test vocabulary) and generation length
SHORT = [5, 6, 7, 8, 9]
LONG = list(range(3, 40))  # 37 tokens: three chunks through the 16-token prefill bucket
MIXED = [[11, 12, 13], list(range(100, 120)), [7, 300, 9, 1000, 2, 55, 66, 77, 88]]
MAX_NEW = 12


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_hf_model(kind: str, out: Path, seed: int = 0) -> Path:
    import transformers

    config_cls, extra, _ = MODELS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF initialises biases to zero: random ones test their handling
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if "bias" in name and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.2)  # e_score_correction_bias (a buffer) included
            if "norm" in name and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.2)  # Gemma's norms start at 0 (they scale by 1 + w)
    model.save_pretrained(out)
    assert (out / "model.safetensors").exists(), f"{kind}: transformers wrote no weights"
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO_MODEL / name, out / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # unlike neffkit's default one
    return out


@functools.cache
def model_digest(kind: str, seed: int = 0) -> str:
    """Everything a test checkpoint is made from: its config, the seed, transformers' version,
    the tokenizer files, the chat template and the code that makes it."""
    import inspect

    import transformers

    recipe = {
        "config": MODELS[kind][:2],
        "common": COMMON,
        "seed": seed,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "maker": inspect.getsource(make_hf_model),
        "template": CHAT_TEMPLATE,
        "tokenizer": [(DEMO_MODEL / n).read_bytes().hex() for n in TOKENIZER_FILES],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def model_dir_name(kind: str) -> str:
    return f"models/{kind}-{model_digest(kind)}"


def make_missing_models() -> None:
    """Every MODELS checkpoint the test cache lacks, made by one process of its own (one import
    of transformers for all): transformers saves nothing in a process whose torch.distributed
    group says rank != 0, and a test worker may hold tracing's fake group."""
    code = (
        "from tests.support.cache import cached_dir\n"
        "from tests.support.models import MODELS, make_hf_model, model_dir_name\n"
        "for kind in MODELS:\n"
        "    cached_dir(model_dir_name(kind), lambda d, k=kind: make_hf_model(k, d))\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)


# The test manifests' sampler: top-k/top-p over 16 candidates, without the inputs only the
# server's tests send (structured outputs' bitmask, penalties, logit bias). Each of those is
# part of every graph (more to trace and compile: a test graph compiles about a third faster
# without them); the bundles whose tests send them (test_server's) ask for them.
LEAN_SAMPLING = {"max_top_k": 16, "structured": False, "max_penalty_tokens": 0, "max_logit_bias": 0}


def write_manifest(path: Path, model_dir: Path, **overrides: Any) -> Path:
    data: dict[str, Any] = {
        "neffkit": 1,
        "name": path.stem,
        "model": str(model_dir),
        "kv_cache": {"block_size": 16},
        "buckets": SMALL,
        "sampling": LEAN_SAMPLING,
    }
    data.update(overrides)
    data = {k: v for k, v in data.items() if v is not None}  # None: a section left out
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # whole or not at all: workers share it
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)
    return path


def hf_greedy_ids(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle's greedy continuation of `prompt` by an HF transformers model (new ids only)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    return out[0, len(prompt) :].tolist()
