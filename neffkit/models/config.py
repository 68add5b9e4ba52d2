"""An HF `config.json` read into the numbers the graphs need: the fields every family shares.

A family (models/<family>/config.py) subclasses ModelConfig with its own fields and reads them
in `from_hf`; `registry.read_model_config` picks the family by architecture. Pure Python (no
torch) so the manifest can validate a model directory without loading weights. Handles both
transformers 4.x (`rope_theta`, `rope_scaling` at the top level) and 5.x (`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from neffkit.errors import ModelError
from neffkit.models.parallel import Parallelism
from neffkit.models.quantization import fp8_scheme, weight_format

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# `hidden_act` values the gated MLP computes as transformers' ACT2FN does (kernels/activation.py)
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
MODELS_DOC = "docs/models.md"

# Config fields that change what a family's HF class computes, with the values neffkit
# implements; any other value is refused naming the field (never built as something else). A
# field absent or null means HF's default, which every family implements. The fields HF's class
# for an architecture does not read change nothing and are not checked. Families extend it.
FieldRules = dict[str, tuple[Any, ...]]
COMMON_RULES: FieldRules = {"hidden_act": ACTIVATIONS}


def refuse_unimplemented(raw: dict[str, Any], rules: FieldRules, path: Path) -> None:
    """A ModelError naming the first field of `raw` whose value `rules` does not implement."""
    arch = (raw.get("architectures") or ["this architecture"])[0]
    for field, implemented in rules.items():
        value = raw.get(field)
        if value is None or value in implemented:
            continue
        raise ModelError(
            f"{path}: {field} = {value!r} is not implemented for {arch}; implemented: "
            f"{', '.join(map(repr, implemented)) or 'none (leave it out)'}",
            hint=f"what each family implements: {MODELS_DOC}",
        )


@dataclass(frozen=True)
class ModelConfig:
    """What every decoder family has. Families add fields (with defaults) in a subclass."""

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
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # the rope parameters as HF reads them (rope_type, rope_theta, factor, ...): sorted pairs
    rope: tuple[tuple[str, Any], ...] = ()
    # fp8 checkpoints: projection weights stay float8_e4m3fn, each [out, in] block with one
    # float32 scale (a 0 spans the dimension: (1, 0) per channel, (0, 0) per tensor); () =
    # unquantized. The checkpoint names a weight's scales `<weight><fp8_scale_suffix>`
    # (DeepSeek: weight_scale_inv; compressed-tensors, fbgemm: weight_scale), multiplied in.
    fp8_block: tuple[int, ...] = ()
    fp8_scale_suffix: str = ""
    # integer / fp4 checkpoints kept at their width (models/quantization.py): the format
    # ("awq", "gptq", "compressed-tensors", "mxfp4", "gguf"; "" = float or fp8) and its
    # quantization_config as sorted pairs
    weight_format: str = ""
    weight_format_options: tuple[tuple[str, Any], ...] = ()
    # each quantized graph weight's scheme (kernels/intquant.QuantScheme.to_id), as the build's
    # layout found them after the tp/ep cut: what the graphs are traced from
    weight_quant: tuple[tuple[str, str], ...] = ()
    # the gated MLP's activation, by its HF name (ACTIVATIONS)
    hidden_act: str = "silu"
    # false: the graphs read no LM head (an embed bundle's return pooled hidden states), so a
    # checkpoint's untied head is neither stored nor required
    lm_head: bool = True

    # the KV cache's kind: "mha" (a K and a V tensor per layer) or "mla" (one latent tensor)
    kv_kind = "mha"

    @property
    def is_moe(self) -> bool:
        """Mixture-of-experts layers (their experts may be split over `parallel.ep`)."""
        return False

    @property
    def kv_width(self) -> int:
        """Values per token per KV head in the cache (MLA: the latent and its rope part)."""
        return self.head_dim

    @property
    def head_is_table(self) -> bool:
        """The LM head projects onto the embedding table (tied, and the graphs have a head)."""
        return self.tie_word_embeddings and self.lm_head

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope) or {"rope_type": "default", "rope_theta": self.rope_theta}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------ the model over `parallel`
    # Errors are ModelErrors naming the manifest field they concern (`field`); the manifest
    # re-raises them with that path, so models/ never depends on the manifest's error type.

    def kv_heads_per_rank(self, par: Parallelism) -> int:
        """KV heads split across ranks, or replicated when tp > num_key_value_heads."""
        if self.kv_kind == "mla":  # one latent row per token, kept whole on every rank
            return 1
        return self.num_kv_heads // par.tp if self.num_kv_heads % par.tp == 0 else 1

    def kv_head_start(self, par: Parallelism, rank: int) -> int:
        if self.num_kv_heads % par.tp == 0:
            return rank * self.kv_heads_per_rank(par)
        return rank // (par.tp // self.num_kv_heads)  # replicated: the head this rank's q uses

    def needs_rank_input(self, par: Parallelism) -> bool:
        """Graphs take `rank` as a tensor where they need it: selecting this rank's vocabulary
        shard (tp > 1) and its local experts (ep > 1). As data, so every rank's graph is one."""
        return par.tp > 1 or (self.is_moe and par.ep > 1)

    def vocab_rows(self, par: Parallelism) -> int:
        """Rows of the embedding / LM head each rank keeps (the last shard zero-padded)."""
        return -(-self.vocab_size // par.tp)

    @property
    def dense_layers(self) -> bool:
        """Some layer runs the dense MLP (its intermediate_size is then split over tp)."""
        return True

    def check_parallelism(self, par: Parallelism) -> None:
        """Layout errors naming the numbers and the manifest field they concern."""
        if self.num_heads % par.tp:
            raise ModelError(
                field="parallel.tp",
                message=f"{par.tp} does not divide the model's {self.num_heads} attention heads",
            )
        kv = self.num_kv_heads
        if kv % par.tp and par.tp % kv:
            raise ModelError(
                field="parallel.tp",
                message=f"{par.tp} and the model's {kv} KV heads do not divide one another",
            )
        if self.dense_layers and self.intermediate_size % par.tp:
            raise ModelError(
                field="parallel.tp",
                message=f"{par.tp} does not divide the model's "
                f"intermediate_size {self.intermediate_size}",
            )
        if par.ep > 1 and not self.is_moe:
            raise ModelError(
                field="parallel.ep", message=f"{par.ep} > 1 needs a mixture-of-experts model"
            )

    # the function-changing fields this family implements (refuse_unimplemented)
    RULES: ClassVar[FieldRules] = COMMON_RULES

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> ModelConfig:
        """The config from a parsed config.json (`path` names it in errors)."""
        return cls(**common_fields(raw, path))

    @classmethod
    def read(cls, raw: dict[str, Any], path: Path) -> ModelConfig:
        """from_hf, after refusing every field value the family does not implement."""
        refuse_unimplemented(raw, cls.RULES, path)
        return cls.from_hf(raw, path)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """`model_dir/config.json`, with generation_config.json's EOS ids folded in."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelError(f"{path}: not found (an HF model directory needs config.json)") from exc
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: invalid JSON: {exc}") from exc
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            raw = {**raw, "eos_token_id": eos}
    return raw


def common_fields(raw: dict[str, Any], path: Path, uniform_window: bool = False) -> dict[str, Any]:
    """The ModelConfig fields of a config.json; a missing required key is a ModelError.
    `uniform_window`: the family applies `sliding_window` to every layer (Mistral, Mixtral)."""
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        rope = rope_parameters(raw, str(path))
        fp8_block, fp8_scale_suffix = fp8_scheme(raw, path)
        int_format, int_options = weight_format(raw, path)
        return {
            "architecture": (raw.get("architectures") or [""])[0],
            "vocab_size": int(raw["vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(raw["intermediate_size"]),
            "num_layers": num_layers,
            "num_heads": heads,
            "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
            "head_dim": int(raw.get("head_dim") or hidden // heads),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope["rope_theta"]),
            "rope": frozen_rope(rope),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "sliding_windows": layer_windows(raw, num_layers, uniform_window),
            "eos_token_ids": _as_ids(raw.get("eos_token_id")),
            "bos_token_id": raw.get("bos_token_id"),
            "fp8_block": fp8_block,
            "fp8_scale_suffix": fp8_scale_suffix,
            "weight_format": int_format,
            "weight_format_options": int_options,
            "hidden_act": str(raw.get("hidden_act") or "silu"),
        }
    except KeyError as exc:
        raise ModelError(f"{path}: missing required key {exc.args[0]!r}") from exc


def required(raw: dict[str, Any], key: str, path: Path) -> Any:
    """raw[key], or a ModelError naming the file and key."""
    if key not in raw or raw[key] is None:
        raise ModelError(f"{path}: missing required key {key!r}")
    return raw[key]


def layer_windows(
    raw: dict[str, Any], num_layers: int, uniform: bool = False
) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `layer_types` (None: full attention), or `sliding_window`
    on every layer where the family says so (`uniform`)."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if uniform and window:
        return (int(window),) * num_layers
    if raw.get("use_sliding_window") and window:
        raise ModelError(
            "config.json: use_sliding_window = true without layer_types is not implemented "
            "(give layer_types: which layers slide)",
            hint=f"what each family implements: {MODELS_DOC}",
        )
    return (None,) * num_layers


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
            f"{where}: rope_parameters.rope_type = {params['rope_type']!r} is not implemented; "
            f"implemented: {', '.join(ROPE_TYPES)}",
            hint=f"what each family implements: {MODELS_DOC}",
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ModelError(
            f"{where}: partial_rotary_factor = {partial} is not implemented (rotary embedding "
            "over the whole head only)",
            hint=f"what each family implements: {MODELS_DOC}",
        )
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


def max_length(params: dict[str, Any]) -> tuple[int, str] | None:
    """The longest sequence the checkpoint declares, and where that number comes from; None when
    config.json gives no max_position_embeddings. Rope scaling extends it as vLLM reads it:
    linear and dynamic scale max_position_embeddings by `factor`, yarn scales
    original_max_position_embeddings (never below max_position_embeddings); llama3 and longrope
    configs already give the extended length as max_position_embeddings."""
    declared = params.get("max_position_embeddings")
    if declared is None:
        return None
    declared = int(declared)
    where = f"max_position_embeddings ({declared})"
    kind, factor = params["rope_type"], params.get("factor")
    if kind in ("linear", "dynamic") and factor:
        return int(declared * factor), f"{where} x rope factor {factor} ({kind})"
    if kind == "yarn":
        original = int(params.get("original_max_position_embeddings") or declared)
        scaled = int(original * (factor or declared / original))
        if scaled > declared:
            return scaled, (
                f"original_max_position_embeddings ({original}) x rope factor {factor} (yarn)"
            )
    return declared, where


def frozen_rope(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Sorted pairs, lists as tuples: a frozen dataclass field."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(params.items()))
