"""Read an HF `config.json` into a ModelConfig: the few numbers the graphs need, validated.

Pure Python (no torch) so the manifest can validate a model directory without loading weights.
Handles both transformers 4.x (`rope_theta`, `rope_scaling` at the top level) and 5.x
(`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import ModelError

# architecture name → family traits. The single list of what neffkit can build.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qk_norm": False, "moe": False},
    "MistralForCausalLM": {"qk_norm": False, "moe": False},
    "Qwen2ForCausalLM": {"qk_norm": False, "moe": False},
    "Qwen3ForCausalLM": {"qk_norm": True, "moe": False},
    "MixtralForCausalLM": {"qk_norm": False, "moe": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": True},
    "GptOssForCausalLM": {"qk_norm": False, "moe": True},
    "DeepseekV3ForCausalLM": {"qk_norm": False, "moe": True},
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Mixture of experts (num_experts 0 = dense). sparse_layers[i]: layer i uses the MoE block.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()
    # the rope parameters as HF reads them (rope_type, rope_theta, factor, ...): sorted pairs
    rope: tuple[tuple[str, Any], ...] = ()
    # GPT-OSS: a learned per-head logit in each softmax denominator (attention sinks); its router
    # takes the top-k logits then softmaxes them; router and experts have biases; its SwiGLU
    # clamps (gate <= limit, |up| <= limit) and gates with sigmoid(alpha * gate), then (up + 1);
    # its RMSNorm multiplies the weight in float32 before the cast back
    attention_sinks: bool = False
    router_topk_first: bool = False
    moe_bias: bool = False
    swiglu_limit: float = 0.0  # 0: the plain SwiGLU, silu(gate) * up
    swiglu_alpha: float = 1.702
    norm_weight_in_float32: bool = False
    # DeepSeek-V3 multi-head latent attention (kv_lora_rank 0: not MLA). head_dim is then the
    # rope part of a query/key head (qk_rope_head_dim), as HF's config has it.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q_proj, no q LoRA
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek-V3 routing: sigmoid scores, a selection-only bias, group-limited top-k, scaling;
    # shared experts next to the routed ones
    router_sigmoid: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    # fp8 checkpoints: projection weights stay float8_e4m3fn, each [out, in] block with one
    # float32 scale (a 0 spans the dimension: (1, 0) per channel, (0, 0) per tensor); () =
    # unquantized. The checkpoint names a weight's scales `<weight><fp8_scale_suffix>`
    # (DeepSeek: weight_scale_inv; compressed-tensors, fbgemm: weight_scale), multiplied in.
    fp8_block: tuple[int, ...] = ()
    fp8_scale_suffix: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_width(self) -> int:
        """Values per token per KV head in the cache (MLA: the latent and its rope part)."""
        return self.kv_lora_rank + self.head_dim if self.is_mla else self.head_dim

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope) or {"rope_type": "default", "rope_theta": self.rope_theta}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["sliding_windows"] = tuple(data["sliding_windows"])
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        data["sparse_layers"] = tuple(data.get("sparse_layers", ()))
        data["rope"] = _frozen_rope(dict(data.get("rope", ())))
        data["fp8_block"] = tuple(data.get("fp8_block", ()))
        return cls(**data)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_parameters(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The rope parameters of an HF config.json: transformers 5.x `rope_parameters` or 4.x
    `rope_scaling` + top-level `rope_theta`, with `type` read as `rope_type`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelError(f"{where}: rope parameters must be an object, got {params!r}")
    params = dict(params)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if params["rope_type"] not in ROPE_TYPES:
        raise ModelError(
            f"{where}: rope type {params['rope_type']!r} is not supported; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelError(f"{where}: partial_rotary_factor != 1 is not supported")
    params["max_position_embeddings"] = cfg.get("max_position_embeddings")
    return params


def check_static(params: dict[str, Any], max_context: int) -> str | None:
    """Why static frequencies cannot equal HF's up to `max_context` tokens (None: they can)."""
    kind = params["rope_type"]
    if kind == "dynamic":
        limit = params.get("max_position_embeddings")
        if limit is None or max_context > limit:
            return (
                f"dynamic NTK rope recomputes its frequencies beyond max_position_embeddings "
                f"({limit}) from the longest sequence seen so far (state kept across requests), "
                f"which a compiled graph cannot reproduce; keep the largest context bucket "
                f"<= {limit}"
            )
    if kind == "longrope":
        limit = params["original_max_position_embeddings"]
        if max_context > limit:
            return (
                f"longrope switches from short to long factors when a forward call's longest "
                f"position passes original_max_position_embeddings ({limit}); a graph with static "
                f"frequencies cannot; keep the largest context bucket <= {limit}"
            )
    return None


def _frozen_rope(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Sorted pairs, lists as tuples: a frozen dataclass field."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(params.items()))


def _head_dim(cfg: dict[str, Any], arch: str, default: int) -> int:
    if arch == "DeepseekV3ForCausalLM":  # the rope part of a head (HF's config says so in 5.x)
        return int(cfg["qk_rope_head_dim"])
    return int(cfg.get("head_dim") or default)


def _mla(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek-V3's latent attention sizes (head_dim is the rope part, qk_rope_head_dim)."""
    if arch != "DeepseekV3ForCausalLM":
        return {}
    return {
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
        "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
        "v_head_dim": int(cfg["v_head_dim"]),
        "rope_interleave": bool(cfg.get("rope_interleave", True)),
    }


def _sliding_windows(cfg: dict[str, Any], num_layers: int, arch: str) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") and window:
        return (int(window),) * num_layers
    if cfg.get("use_sliding_window") and window:
        raise ModelError("config.json: use_sliding_window without layer_types is not supported")
    return (None,) * num_layers


def _moe(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """MoE fields as HF computes them (Mixtral: every layer, always renormalised top-k;
    Qwen3-MoE: `decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`)."""
    if not ARCHITECTURES[arch]["moe"]:
        return {}
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if arch == "DeepseekV3ForCausalLM":
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        inter = int(cfg["moe_intermediate_size"])
        return {
            "num_experts": int(cfg["n_routed_experts"]),
            "experts_per_token": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": inter,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "sparse_layers": tuple(i >= first_dense for i in range(num_layers)),
            "router_sigmoid": True,
            "router_groups": int(cfg.get("n_group") or 1),
            "router_topk_groups": int(cfg.get("topk_group") or 1),
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
            "shared_intermediate_size": inter * int(cfg.get("n_shared_experts") or 0),
        }
    if arch == "GptOssForCausalLM":
        return {
            "num_experts": experts,
            "experts_per_token": int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "sparse_layers": (True,) * num_layers,
            "attention_sinks": True,
            "router_topk_first": True,
            "moe_bias": True,
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "norm_weight_in_float32": True,
        }
    if arch == "MixtralForCausalLM":
        sparse = (True,) * num_layers
        inter, norm = int(cfg["intermediate_size"]), True
    else:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(
            i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        inter, norm = int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False))
    return {
        "num_experts": experts,
        "experts_per_token": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": inter,
        "norm_topk_prob": norm,
        "sparse_layers": sparse,
    }


# fp8 scale layouts as [block_out, block_in]; 0 spans the whole dimension
PER_TENSOR, PER_CHANNEL = (0, 0), (1, 0)
CT_STRATEGIES = {"tensor": PER_TENSOR, "channel": PER_CHANNEL}


def _quantization(cfg: dict[str, Any], path: Path) -> tuple[tuple[int, ...], str]:
    """(fp8 scale block, the checkpoint's scale-tensor suffix) of an fp8 checkpoint; ((), "")
    when unquantized. Weight-only: activations stay in the model dtype (W8A16).

    Read: DeepSeek's fine-grained fp8 (quant_method fp8, `weight_scale_inv` per block),
    compressed-tensors float-quantized fp8 (`weight_scale` per tensor, channel or block) and
    FBGEMM fp8 (`weight_scale` per output channel). Every other method is refused by name:
    widening quantized tensors without their scales builds a bundle that generates garbage."""
    quant = cfg.get("quantization_config")
    if not quant:
        return (), ""
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    where = f"{path}: quantization_config"
    if method == "mxfp4":
        raise ModelError(
            f"{path}: mxfp4-quantized experts (GPT-OSS's release layout) are not supported",
            hint="dequantize to bfloat16 first: load with transformers' "
            "Mxfp4Config(dequantize=True) and save_pretrained",
        )
    if method == "fp8":
        block = _block(quant.get("weight_block_size"), f"{where}.weight_block_size")
        suffix = "_scale_inv"
    elif method == "fbgemm_fp8":
        block, suffix = PER_CHANNEL, "_scale"
    elif method == "compressed-tensors":
        block, suffix = _compressed_tensors(quant, where), "_scale"
    else:
        raise ModelError(
            f"{where}.quant_method {method!r} is not supported (neffkit reads unquantized "
            "float32/bfloat16/float16 checkpoints and fp8 ones: fp8 block, compressed-tensors "
            "fp8, fbgemm_fp8)",
            hint="dequantize the checkpoint first (transformers: load it, then save_pretrained "
            "with an unquantized torch_dtype)",
        )
    if (cfg.get("architectures") or [None])[0] == "GptOssForCausalLM":
        raise ModelError(f"{path}: fp8 GPT-OSS checkpoints are not supported")
    return block, suffix


def _block(value: Any, where: str) -> tuple[int, int]:
    if not (
        isinstance(value, list) and len(value) == 2
        and all(isinstance(b, int) and b > 0 for b in value)
    ):  # fmt: skip
        raise ModelError(f"{where}: {value!r} is not a block shape [out, in] of positive ints")
    return (int(value[0]), int(value[1]))


def _compressed_tensors(quant: dict[str, Any], where: str) -> tuple[int, int]:
    """The one fp8 weight scheme of a compressed-tensors config (every group must agree)."""
    if quant.get("format") not in ("float-quantized", "naive-quantized"):
        raise ModelError(
            f"{where}.format {quant.get('format')!r} is not supported (neffkit reads "
            "compressed-tensors fp8 weights: format float-quantized)"
        )
    schemes = set()
    for group, body in (quant.get("config_groups") or {}).items():
        w = (body or {}).get("weights") or {}
        at = f"{where}.config_groups.{group}.weights"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ModelError(
                f"{at}: {w.get('type')!r} with {w.get('num_bits')!r} bits is not supported "
                "(neffkit reads 8-bit float weights)"
            )
        strategy = w.get("strategy")
        if strategy == "block":
            schemes.add(_block(w.get("block_structure"), f"{at}.block_structure"))
        elif strategy in CT_STRATEGIES:
            schemes.add(CT_STRATEGIES[strategy])
        else:
            raise ModelError(
                f"{at}.strategy {strategy!r} is not supported (tensor, channel or block)"
            )
    if len(schemes) != 1:
        raise ModelError(
            f"{where}.config_groups: {len(schemes)} weight schemes; neffkit reads exactly one"
        )
    return schemes.pop()


def read_model_config(model_dir: Path) -> ModelConfig:
    """Parse `model_dir/config.json` (+ generation_config.json for EOS ids)."""
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelError(f"{path}: not found (an HF model directory needs config.json)") from exc
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: invalid JSON: {exc}") from exc
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    fp8_block, fp8_scale_suffix = _quantization(cfg, path)
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        rope = rope_parameters(cfg, str(path))
        eos = cfg.get("eos_token_id")
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=_head_dim(cfg, arch, hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            rope=_frozen_rope(rope),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=ARCHITECTURES[arch]["qk_norm"],
            sliding_windows=_sliding_windows(cfg, num_layers, arch),
            eos_token_ids=_as_ids(eos),
            bos_token_id=cfg.get("bos_token_id"),
            **_moe(cfg, arch, num_layers),
            **_mla(cfg, arch),
            fp8_block=fp8_block,
            fp8_scale_suffix=fp8_scale_suffix,
        )
    except KeyError as exc:
        raise ModelError(f"{path}: missing required key {exc.args[0]!r}") from exc
