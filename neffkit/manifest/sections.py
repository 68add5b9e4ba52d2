"""The manifest's sections, each read and validated on its own (every error names its path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neffkit.contract.abi import KV_KINDS
from neffkit.errors import ManifestError
from neffkit.manifest.fields import (
    bucket_list,
    choice,
    describe,
    mapping,
    no_unknown,
    non_negative_int,
    positive_int,
    string_list,
)
from neffkit.manifest.schema import (
    INDUCTOR_CHOICES,
    INDUCTOR_OPTIONS,
    KV_DTYPES,
    SPECULATION_METHODS,
    Audit,
    Buckets,
    Compiler,
    GraphRule,
    KVCache,
    NeuronOptions,
    Sampling,
    Speculation,
)
from neffkit.models.config import ModelConfig
from neffkit.models.parallel import Parallelism
from neffkit.targets import AUDIT_RULE_IDS, DTYPE_BYTES, NEURON_TARGETS, PHASES


def read_inductor_options(value: Any, path: str) -> dict[str, Any]:
    data = mapping(value, path)
    for key, v in data.items():
        if key not in INDUCTOR_OPTIONS:
            raise ManifestError(
                f"{path}.{key}: not an allowed AOTInductor option; allowed: "
                f"{', '.join(INDUCTOR_OPTIONS)}"
            )
        expected = INDUCTOR_OPTIONS[key]
        if isinstance(v, bool) and expected is int or not isinstance(v, expected):
            name = expected.__name__ if isinstance(expected, type) else "value"
            raise ManifestError(f"{path}.{key}: expected {name}, got {describe(v)}")
        if key in INDUCTOR_CHOICES:
            choice(v, INDUCTOR_CHOICES[key], f"{path}.{key}")
    return dict(data)


def read_match(value: Any, path: str) -> dict[str, Any]:
    data = mapping(value, path)
    no_unknown(data, ("phase", "tokens", "batch", "context"), path)
    out: dict[str, Any] = {}
    for key, v in data.items():
        if key == "phase":
            out[key] = choice(v, PHASES, f"{path}.phase")
        elif isinstance(v, list):
            if len(v) != 2:
                raise ManifestError(f"{path}.{key}: expected an int or [lo, hi], got {v!r}")
            lo, hi = (positive_int(x, f"{path}.{key}[{i}]") for i, x in enumerate(v))
            if lo > hi:
                raise ManifestError(f"{path}.{key}: range [{lo}, {hi}] is empty")
            out[key] = [lo, hi]
        else:
            out[key] = positive_int(v, f"{path}.{key}")
    return out


def read_compiler(value: Any, path: str) -> Compiler:
    data = mapping(value, path)
    no_unknown(data, ("flags", "inductor", "per_graph", "cpu_kernel"), path)
    rules = []
    raw_rules = data.get("per_graph", [])
    if not isinstance(raw_rules, list):
        raise ManifestError(
            f"{path}.per_graph: expected a list of rules, got {describe(raw_rules)}"
        )
    for i, raw in enumerate(raw_rules):
        rule_path = f"{path}.per_graph[{i}]"
        rule = mapping(raw, rule_path)
        no_unknown(rule, ("match", "flags", "inductor"), rule_path)
        if "match" not in rule:
            raise ManifestError(f"{rule_path}.match: required")
        rules.append(
            GraphRule(
                match=read_match(rule["match"], f"{rule_path}.match"),
                flags=string_list(rule.get("flags", []), f"{rule_path}.flags"),
                inductor=read_inductor_options(rule.get("inductor", {}), f"{rule_path}.inductor"),
            )
        )
    return Compiler(
        flags=string_list(data.get("flags", []), f"{path}.flags"),
        inductor=read_inductor_options(data.get("inductor", {}), f"{path}.inductor"),
        per_graph=tuple(rules),
        cpu_kernel=read_cpu_kernel(data.get("cpu_kernel", "auto"), f"{path}.cpu_kernel"),
    )


CPU_KERNEL = ("auto", "on", "off")


def read_cpu_kernel(value: Any, path: str) -> str:
    if isinstance(value, bool):  # YAML 1.1 reads a bare on/off as a boolean
        value = "on" if value else "off"
    return choice(value, CPU_KERNEL, path)


def read_neuron(data: dict[str, Any], target: str) -> NeuronOptions | None:
    if "neuron" not in data:
        return NeuronOptions() if target == "neuron" else None
    raw = mapping(data["neuron"], "neuron")
    no_unknown(raw, ("target", "lnc"), "neuron")
    if target != "neuron":
        raise ManifestError(f"neuron: only valid with target: neuron (target is {target!r})")
    return NeuronOptions(
        target=choice(raw.get("target", "trn2"), NEURON_TARGETS, "neuron.target"),
        lnc=positive_int(raw.get("lnc", 2), "neuron.lnc"),
    )


def read_parallel(value: Any) -> Parallelism:
    raw = mapping(value, "parallel")
    no_unknown(raw, ("tp", "ep", "per_rank_artifacts"), "parallel")
    per_rank = read_flag(raw.get("per_rank_artifacts", False), "parallel.per_rank_artifacts")
    parallel = Parallelism(
        tp=positive_int(raw.get("tp", 1), "parallel.tp"),
        ep=positive_int(raw.get("ep", 1), "parallel.ep"),
        per_rank_artifacts=per_rank,
    )
    if parallel.tp % parallel.ep:
        raise ManifestError(f"parallel.ep: {parallel.ep} must divide parallel.tp ({parallel.tp})")
    return parallel


def read_mla(value: Any, cfg: ModelConfig) -> str:
    raw = mapping(value, "mla")
    no_unknown(raw, ("decode",), "mla")
    if raw and cfg.kv_kind != "mla":
        raise ManifestError(f"mla: the model ({cfg.architecture}) has no latent attention")
    return choice(raw.get("decode", "absorbed"), ("absorbed", "expanded"), "mla.decode")


def read_flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ManifestError(f"{path}: expected true or false, got {describe(value)}")
    return value


def read_sampling(value: Any) -> Sampling:
    raw = mapping(value, "sampling")
    keys = (
        "max_top_k",
        "max_logprobs",
        "prompt_logprobs",
        "structured",
        "max_penalty_tokens",
        "max_logit_bias",
    )
    no_unknown(raw, keys, "sampling")
    penalty = raw.get("max_penalty_tokens")
    return Sampling(
        max_top_k=positive_int(raw.get("max_top_k", 64), "sampling.max_top_k"),
        max_logprobs=positive_int(raw.get("max_logprobs", 5), "sampling.max_logprobs"),
        prompt_logprobs=read_flag(raw.get("prompt_logprobs", False), "sampling.prompt_logprobs"),
        structured=read_flag(raw.get("structured", True), "sampling.structured"),
        max_penalty_tokens=None
        if penalty is None
        else non_negative_int(penalty, "sampling.max_penalty_tokens"),
        max_logit_bias=non_negative_int(raw.get("max_logit_bias", 300), "sampling.max_logit_bias"),
    )


def read_buckets(value: Any, decode: bool = True) -> Buckets:  # decode false: task embed
    raw = mapping(value, "buckets")
    keys = ("prefill", "decode", "context", "prefill_batch", "allow_long_context")
    no_unknown(raw, keys, "buckets")
    for key in ("prefill", "decode", "context") if decode else ("prefill", "context"):
        if key not in raw:
            raise ManifestError(f"buckets.{key}: required field is missing")
    buckets = Buckets(
        prefill=bucket_list(raw["prefill"], "buckets.prefill"),
        decode=bucket_list(raw["decode"], "buckets.decode") if decode else (),
        context=bucket_list(raw["context"], "buckets.context"),
        prefill_batch=bucket_list(raw.get("prefill_batch", [1]), "buckets.prefill_batch"),
        allow_long_context=read_flag(
            raw.get("allow_long_context", False), "buckets.allow_long_context"
        ),
    )
    if buckets.prefill_batch[0] != 1:
        raise ManifestError(
            f"buckets.prefill_batch[0]: {buckets.prefill_batch[0]}; the list must start with 1 "
            "(a lone prompt, or one asking for prompt logprobs, prefills in a one-row graph)",
            hint=f"write [1, {', '.join(map(str, buckets.prefill_batch))}]",
        )
    for i, tokens in enumerate(buckets.prefill):  # a chunk longer than any context: no graph
        if tokens > buckets.context[-1]:
            raise ManifestError(
                f"buckets.prefill[{i}]: {tokens} exceeds the largest context bucket "
                f"({buckets.context[-1]}); no graph could be built for it",
                hint=f"drop it, or add a context bucket of at least {tokens}",
            )
    return buckets


KV_CACHE_KEYS = (
    "block_size",
    "num_blocks",
    "dtype",
    "memory_mb",
    "prefix_caching",
    "calibrate",
    "rotate_keys",
    "hybrid",
)


def read_kv_cache(
    value: Any, buckets: Buckets, dtype: str, cfg: ModelConfig, par: Parallelism
) -> KVCache:
    raw = mapping(value, "kv_cache")
    no_unknown(raw, KV_CACHE_KEYS, "kv_cache")
    prefix_caching, calibrate, rotate_keys, hybrid = _kv_flags(raw)
    kv_dtype = raw.get("dtype")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ManifestError(
            f"kv_cache.dtype: {kv_dtype!r} is not supported; supported: {', '.join(KV_DTYPES)} "
            "(or leave it out for the model dtype)"
        )
    if kv_dtype is not None and cfg.kv_kind == "mla":
        raise ManifestError(
            f"kv_cache.dtype: {kv_dtype} latent (MLA) caches are not supported yet",
            hint="leave kv_cache.dtype out: the latent cache is already 71x smaller than K/V",
        )
    kv_dtype = kv_dtype or dtype  # resolved once: the model dtype unless fp8 was asked for
    block_size = positive_int(raw.get("block_size", 16), "kv_cache.block_size")
    for key in ("prefill", "context"):
        for i, b in enumerate(getattr(buckets, key)):
            if b % block_size:
                raise ManifestError(
                    f"buckets.{key}[{i}]: {b} is not a multiple of kv_cache.block_size "
                    f"({block_size})"
                )
    # Default: every decode row (embed: prefill row) holds the largest context, + null block 0
    rows = (buckets.decode or buckets.prefill_batch)[-1]
    default_blocks = buckets.context[-1] * rows // block_size + 1
    memory_mb = raw.get("memory_mb")
    if memory_mb is not None:
        memory_mb = positive_int(memory_mb, "kv_cache.memory_mb")
        if "num_blocks" in raw:
            raise ManifestError(
                "kv_cache: give num_blocks or memory_mb, not both",
                hint="memory_mb sizes num_blocks from a per-rank budget",
            )
        per_token = kv_bytes_per_token(cfg, par, kv_dtype)
        default_blocks = memory_mb * 2**20 // (block_size * per_token)
    num_blocks = positive_int(raw.get("num_blocks", default_blocks), "kv_cache.num_blocks")
    if buckets.context[-1] > (num_blocks - 1) * block_size:
        raise ManifestError(
            f"kv_cache.num_blocks: {num_blocks} blocks of {block_size} tokens "
            "(block 0 is reserved) "
            f"cannot hold the largest context bucket ({buckets.context[-1]} tokens)",
            hint=f"use num_blocks >= {buckets.context[-1] // block_size + 1}",
        )
    return KVCache(
        block_size=block_size,
        num_blocks=num_blocks,
        dtype=kv_dtype,
        memory_mb=memory_mb,
        prefix_caching=prefix_caching,
        calibrate=calibrate,
        rotate_keys=rotate_keys,
        hybrid=hybrid,
    )


def _kv_flags(raw: dict[str, Any]) -> tuple[bool, bool, bool | None, bool]:
    """kv_cache.prefix_caching, calibrate and rotate_keys (fp8 caches only), and hybrid."""
    flags = {"prefix_caching": True, "calibrate": True, "rotate_keys": None, "hybrid": True}
    for key, default in flags.items():
        flag = flags[key] = raw.get(key, default)
        if flag is not default and not isinstance(flag, bool):
            raise ManifestError(f"kv_cache.{key}: expected true or false, got {flag!r}")
    for key, what in (("calibrate", "scales to calibrate"), ("rotate_keys", "keys to rotate")):
        if key in raw and raw.get("dtype") != "float8_e4m3fn":
            raise ManifestError(
                f"kv_cache.{key}: only an fp8 cache has {what}",
                hint=f"set kv_cache.dtype: float8_e4m3fn, or leave {key} out",
            )
    if flags["rotate_keys"] and not flags["calibrate"]:
        raise ManifestError(
            "kv_cache.rotate_keys: rotated keys need scales calibrated on them",
            hint="leave kv_cache.calibrate out (true), or rotate_keys out",
        )
    # a flag with a bool default is a bool here (anything else raised above)
    caching, calibrate, hybrid = (bool(flags[k]) for k in ("prefix_caching", "calibrate", "hybrid"))
    return caching, calibrate, flags["rotate_keys"], hybrid


LM_HEAD_DTYPES = ("float8_e4m3fn",)


def read_lm_head(value: Any, cfg: ModelConfig, model_path: Path) -> str | None:
    """`lm_head.dtype`: None keeps the bundle dtype; float8_e4m3fn needs an fp8 checkpoint,
    whose scale blocks quantize the head too (a vocabulary-sized head is a third of a small
    model's decode step: SmolLM2-135M's is 56.6 MB in bf16 of ~163 MB)."""
    raw = mapping(value, "lm_head")
    no_unknown(raw, ("dtype",), "lm_head")
    dtype = raw.get("dtype")
    if dtype is None:
        return None
    if dtype not in LM_HEAD_DTYPES:
        raise ManifestError(
            f"lm_head.dtype: {dtype!r} is not supported; supported: {', '.join(LM_HEAD_DTYPES)} "
            "(or leave it out for the model dtype)"
        )
    if not cfg.fp8_block:
        raise ManifestError(
            f"lm_head.dtype: {dtype} needs an fp8 checkpoint (its scale blocks quantize the "
            f"head); {model_path} is not quantized",
            hint="quantize the checkpoint first (e.g. llm-compressor's FP8 block scheme), or "
            "leave lm_head out",
        )
    return dtype


def kv_bytes_per_token(cfg: ModelConfig, par: Parallelism, dtype: str) -> int:
    """Cache bytes one token takes on one rank, every layer (K and V; MLA: the latent row)."""
    tensors = cfg.num_layers * len(KV_KINDS[cfg.kv_kind])
    return tensors * cfg.kv_heads_per_rank(par) * cfg.kv_width * DTYPE_BYTES[dtype]


def read_audit(value: Any) -> Audit:
    raw = mapping(value, "audit")
    no_unknown(raw, ("waive",), "audit")
    waive = string_list(raw.get("waive", []), "audit.waive")
    for i, rule in enumerate(waive):
        if rule not in AUDIT_RULE_IDS:
            raise ManifestError(
                f"audit.waive[{i}]: unknown rule {rule!r}; rules: {', '.join(AUDIT_RULE_IDS)}"
            )
    return Audit(waive=waive)


def read_speculation(value: Any, buckets: Buckets) -> Speculation | None:
    """The `speculation` section, or None without one (a draft's `model` is read by the caller,
    which knows the manifest's folder and the target's config)."""
    if value is None:
        return None
    raw = mapping(value, "speculation")
    keys = ("method", "num_tokens", "max_batch", "prompt_lookup_min", "prompt_lookup_max", "model")
    no_unknown(raw, keys, "speculation")
    method = choice(raw.get("method"), SPECULATION_METHODS, "speculation.method")
    only = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft": ("model",)}
    for other, fields in only.items():
        for name in fields:
            if other != method and name in raw:
                raise ManifestError(f"speculation.{name}: only for method {other}, not {method}")
    if method == "draft" and "model" not in raw:
        raise ManifestError(
            "speculation.model: required for method draft (the draft checkpoint's directory)"
        )
    k = positive_int(raw.get("num_tokens", 4), "speculation.num_tokens")
    if 1 + k >= buckets.context[-1]:
        raise ManifestError(
            f"speculation.num_tokens: {k} draft tokens do not fit the largest context bucket "
            f"({buckets.context[-1]})"
        )
    for i, context in enumerate(buckets.context):  # the build makes no verify graph there
        if 1 + k >= context:
            raise ManifestError(
                f"speculation.num_tokens: {k} draft tokens do not fit context bucket "
                f"buckets.context[{i}] ({context}); no verify graph could be built for it",
                hint=f"use num_tokens < {buckets.context[0] - 1}",
            )
    max_batch = positive_int(raw.get("max_batch", buckets.decode[-1]), "speculation.max_batch")
    if max_batch < buckets.decode[0]:
        raise ManifestError(
            f"speculation.max_batch: {max_batch} is below the smallest decode bucket "
            f"({buckets.decode[0]}); no verify graph could be built",
            hint=f"use max_batch >= {buckets.decode[0]}, or leave speculation out",
        )
    low = positive_int(raw.get("prompt_lookup_min", 2), "speculation.prompt_lookup_min")
    high = positive_int(raw.get("prompt_lookup_max", max(4, low)), "speculation.prompt_lookup_max")
    if low > high:
        raise ManifestError(
            f"speculation.prompt_lookup_min: {low} exceeds prompt_lookup_max ({high})"
        )
    return Speculation(
        method=method,
        num_tokens=k,
        max_batch=max_batch,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
    )
