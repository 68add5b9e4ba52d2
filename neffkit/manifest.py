"""The manifest (schema 1): YAML → frozen dataclasses, strictly validated.

Every error names the field path and the bad value and says what was expected, e.g.
`buckets.decode[1]: expected a positive int, got -4`. Unknown keys are errors. Relative paths
resolve against the manifest's folder. Imports no torch and nothing from neffkit.compile: target
names and audit rule ids come from the leaf module neffkit.targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from neffkit.errors import ManifestError, ModelError
from neffkit.models.config import ModelConfig, check_static, read_model_config
from neffkit.models.parallel import Parallelism as ParallelLayout
from neffkit.models.parallel import check_parallelism
from neffkit.targets import (
    AUDIT_RULE_IDS,
    DTYPE_BYTES,
    DTYPES,
    NEURON_TARGETS,
    PHASES,
    TARGETS,
    fp8_max,
)

SCHEMA_VERSION = 1
# AOTInductor options a manifest may set (compiler.inductor), with their value types.
INDUCTOR_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "max_autotune": bool,
    "epilogue_fusion": bool,
    "cpp.simdlen": int,
    "cpp.threads": int,
    "aot_inductor.debug_compile": bool,
    "fallback_random": bool,
}


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    ep: int = 1
    # Compile one artifact per rank where ranks trace different graphs, instead of failing
    # the build with SPMDMismatchError. Counted in the build report and shown by inspect.
    per_rank_artifacts: bool = False


KV_DTYPES = ("float8_e4m3fn",)  # beside the model dtype (the default)


@dataclass(frozen=True)
class KVCache:
    block_size: int
    num_blocks: int
    # None: the model dtype. float8_e4m3fn: clamp(x / k_scale, ±M) stored, M the target's fp8
    # range (targets.fp8_max), k_scale/v_scale per layer from the checkpoint, else 1.0
    dtype: str | None = None
    # num_blocks from a per-rank memory budget (MiB) instead, sized by the cache dtype's width
    memory_mb: int | None = None


@dataclass(frozen=True)
class Buckets:
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    context: tuple[int, ...]
    # rows of a prefill graph: several waiting prompts' chunks in one call (packing a burst of
    # arrivals); 1 always, since a lone prompt runs cheapest alone
    prefill_batch: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class Sampling:
    # top-k / top-p choose among the N most likely tokens (a static shape: a sort of the whole
    # vocabulary costs milliseconds per row); a request asking for top_k above N is refused.
    # Requests with neither sample the whole vocabulary, whatever N.
    max_top_k: int = 64
    # logprobs: the sampled token's and up to N alternatives' (OpenAI `logprobs`/`top_logprobs`)
    max_logprobs: int = 5
    # prefill graphs also return every prompt token's logprobs (echo + logprobs, lm-eval's
    # loglikelihood). Off by default, as TensorRT-LLM's gather_context_logits: it runs the LM
    # head on every prompt position, not only the last.
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class NeuronOptions:
    target: str = "trn2"
    lnc: int = 2


@dataclass(frozen=True)
class GraphRule:
    """A per-graph compiler rule; `match` keys: phase, tokens, batch, context (int or [lo, hi])."""

    match: dict[str, Any]
    flags: tuple[str, ...] = ()
    inductor: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Compiler:
    flags: tuple[str, ...] = ()
    inductor: dict[str, Any] = field(default_factory=dict)
    per_graph: tuple[GraphRule, ...] = ()
    # cpu: decode projections through neffkit's C++ kernel (neffkit/cpu_kernels.py): "auto"
    # (weights of 1 MiB or more, where the host has AVX-512), "on" (every one), "off"
    cpu_kernel: str = "auto"


@dataclass(frozen=True)
class Audit:
    waive: tuple[str, ...] = ()  # rule ids whose errors do not fail the build (recorded)


@dataclass(frozen=True)
class Manifest:
    name: str
    model: Path
    dtype: str
    target: str
    neuron: NeuronOptions | None
    parallel: Parallel
    kv_cache: KVCache
    buckets: Buckets
    sampling: Sampling
    compiler: Compiler
    model_config: ModelConfig
    audit: Audit = Audit()
    source: Path | None = None
    # MLA decode (DeepSeek): "absorbed" attends in the latent space (reads the latent cache);
    # "expanded" up-projects the context to per-head K/V every step (HF's form; for comparison)
    mla_decode: str = "absorbed"
    # where decode graphs get each row's input token: "host" sends it as `input_ids`; "device"
    # reads it from the aliased `last_tokens` state the previous step wrote, the host sending
    # only which sequence each row holds (`seq_slots`). Default: device on neuron, else host
    decode_state: str = "host"

    @property
    def max_model_len(self) -> int:
        return self.buckets.context[-1]

    @property
    def fp8_max(self) -> float:
        """The range fp8 values may use on this target (240 on trn1/trn2, else 448)."""
        return fp8_max(self.target, self.neuron.target if self.neuron else None)

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache.dtype == "float8_e4m3fn"

    @property
    def uses_fp8(self) -> bool:
        """fp8 values in the graphs: fp8 checkpoint weights or an fp8 KV cache."""
        return bool(self.model_config.fp8_block) or self.fp8_kv_cache

    def to_json(self) -> dict[str, Any]:
        """The resolved manifest as bundle.json stores it: absolute model path, defaults filled."""
        data = asdict(self)
        data.pop("model_config")
        data.pop("source")
        data["neffkit"] = SCHEMA_VERSION
        data["model"] = str(self.model)
        return data


# ---------------------------------------------------------------- field readers


def _describe(value: Any) -> str:
    return repr(value) if not isinstance(value, dict | list) else type(value).__name__


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{path}: expected a mapping, got {_describe(value)}")
    return value


def _no_unknown(data: dict[str, Any], allowed: tuple[str, ...], path: str) -> None:
    for key in data:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            raise ManifestError(
                f"{where}: unknown key; allowed here: {', '.join(allowed)}",
                hint="check the spelling against the manifest schema in the README",
            )


def _positive_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ManifestError(f"{path}: expected a positive int, got {_describe(value)}")
    return value


def _choice(value: Any, choices: tuple[str, ...], path: str) -> str:
    if value not in choices:
        raise ManifestError(f"{path}: unknown value {value!r}; available: {', '.join(choices)}")
    return value


def _bucket_list(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ManifestError(
            f"{path}: expected a non-empty list of positive ints, got {_describe(value)}"
        )
    items = tuple(_positive_int(v, f"{path}[{i}]") for i, v in enumerate(value))
    for i in range(1, len(items)):
        if items[i] <= items[i - 1]:
            raise ManifestError(
                f"{path}[{i}]: buckets must be sorted and unique, got {list(items)}",
                hint=f"write them ascending: {sorted(set(items))}",
            )
    return items


def _string_list(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ManifestError(f"{path}: expected a list of strings, got {_describe(value)}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise ManifestError(f"{path}[{i}]: expected a string, got {_describe(v)}")
    return tuple(value)


def _inductor_options(value: Any, path: str) -> dict[str, Any]:
    data = _mapping(value, path)
    for key, v in data.items():
        if key not in INDUCTOR_OPTIONS:
            raise ManifestError(
                f"{path}.{key}: not an allowed AOTInductor option; allowed: "
                f"{', '.join(INDUCTOR_OPTIONS)}"
            )
        expected = INDUCTOR_OPTIONS[key]
        if isinstance(v, bool) and expected is int or not isinstance(v, expected):
            name = expected.__name__ if isinstance(expected, type) else "value"
            raise ManifestError(f"{path}.{key}: expected {name}, got {_describe(v)}")
    return dict(data)


def _match(value: Any, path: str) -> dict[str, Any]:
    data = _mapping(value, path)
    _no_unknown(data, ("phase", "tokens", "batch", "context"), path)
    out: dict[str, Any] = {}
    for key, v in data.items():
        if key == "phase":
            out[key] = _choice(v, PHASES, f"{path}.phase")
        elif isinstance(v, list):
            if len(v) != 2:
                raise ManifestError(f"{path}.{key}: expected an int or [lo, hi], got {v!r}")
            lo, hi = (_positive_int(x, f"{path}.{key}[{i}]") for i, x in enumerate(v))
            if lo > hi:
                raise ManifestError(f"{path}.{key}: range [{lo}, {hi}] is empty")
            out[key] = [lo, hi]
        else:
            out[key] = _positive_int(v, f"{path}.{key}")
    return out


def _compiler(value: Any, path: str) -> Compiler:
    data = _mapping(value, path)
    _no_unknown(data, ("flags", "inductor", "per_graph", "cpu_kernel"), path)
    rules = []
    raw_rules = data.get("per_graph", [])
    if not isinstance(raw_rules, list):
        raise ManifestError(
            f"{path}.per_graph: expected a list of rules, got {_describe(raw_rules)}"
        )
    for i, raw in enumerate(raw_rules):
        rule_path = f"{path}.per_graph[{i}]"
        rule = _mapping(raw, rule_path)
        _no_unknown(rule, ("match", "flags", "inductor"), rule_path)
        if "match" not in rule:
            raise ManifestError(f"{rule_path}.match: required")
        rules.append(
            GraphRule(
                match=_match(rule["match"], f"{rule_path}.match"),
                flags=_string_list(rule.get("flags", []), f"{rule_path}.flags"),
                inductor=_inductor_options(rule.get("inductor", {}), f"{rule_path}.inductor"),
            )
        )
    return Compiler(
        flags=_string_list(data.get("flags", []), f"{path}.flags"),
        inductor=_inductor_options(data.get("inductor", {}), f"{path}.inductor"),
        per_graph=tuple(rules),
        cpu_kernel=_cpu_kernel(data.get("cpu_kernel", "auto"), f"{path}.cpu_kernel"),
    )


CPU_KERNEL = ("auto", "on", "off")


def _cpu_kernel(value: Any, path: str) -> str:
    if isinstance(value, bool):  # YAML 1.1 reads a bare on/off as a boolean
        value = "on" if value else "off"
    return _choice(value, CPU_KERNEL, path)


# ---------------------------------------------------------------- the manifest

TOP_LEVEL = (
    "neffkit",
    "name",
    "model",
    "dtype",
    "target",
    "neuron",
    "parallel",
    "kv_cache",
    "buckets",
    "sampling",
    "compiler",
    "audit",
    "mla",
    "decode_state",
)
DECODE_STATES = ("host", "device")


def _model_dir(value: Any, base: Path) -> tuple[Path, ModelConfig]:
    if not isinstance(value, str) or not value:
        raise ManifestError(
            f"model: expected a path to an HF model directory, got {_describe(value)}"
        )
    path = (base / value).resolve()
    if not path.is_dir():
        raise ManifestError(f"model: directory {path} does not exist")
    if not (path / "config.json").exists():
        raise ManifestError(f"model: {path} has no config.json (is it an HF model directory?)")
    if not any(path.glob("*.safetensors")):
        raise ManifestError(
            f"model: {path} has no *.safetensors files",
            hint="save the model with save_pretrained(..., safe_serialization=True)",
        )
    try:
        return path, read_model_config(path)
    except ModelError as exc:
        raise ManifestError(f"model: {exc.message}", exc.hint) from exc


def parse_manifest(data: Any, base: Path, name: str = "manifest") -> Manifest:
    """Validate a parsed YAML document; `base` is the folder relative paths resolve against."""
    data = _mapping(data, "manifest")
    _no_unknown(data, TOP_LEVEL, "")
    for key in ("neffkit", "model", "buckets"):
        if key not in data:
            raise ManifestError(f"{key}: required field is missing")
    if data["neffkit"] != SCHEMA_VERSION:
        raise ManifestError(
            f"neffkit: unsupported manifest schema {data['neffkit']!r}; this neffkit reads schema "
            f"{SCHEMA_VERSION}"
        )
    display_name = data.get("name", name)
    if not isinstance(display_name, str) or not display_name:
        raise ManifestError(f"name: expected a non-empty string, got {_describe(display_name)}")
    dtype = _choice(data.get("dtype", "float32"), DTYPES, "dtype")
    target = _choice(data.get("target", "cpu"), TARGETS, "target")
    neuron = _neuron(data, target)
    parallel = _parallel(data.get("parallel", {}))
    buckets = _buckets(data["buckets"])
    sampling = _sampling(data.get("sampling", {}))
    compiler = _compiler(data.get("compiler", {}), "compiler")
    audit = _audit(data.get("audit", {}))
    model_path, model_config = _model_dir(data["model"], base)
    try:
        check_parallelism(model_config, ParallelLayout(parallel.tp, parallel.ep))
    except ModelError as exc:  # models/ knows the layout, the manifest knows where it was set
        raise ManifestError(f"{exc.field or 'parallel'}: {exc.message}", exc.hint) from exc
    static_rope = check_static(model_config.rope_params, buckets.context[-1])
    if static_rope is not None:
        raise ManifestError(f"buckets.context: {static_rope}")
    mla_decode = _mla(data.get("mla", {}), model_config)
    kv_cache = _kv_cache(
        data.get("kv_cache", {}),
        buckets,
        dtype,
        model_config,
        ParallelLayout(parallel.tp, parallel.ep),
    )
    if kv_cache.dtype and model_config.is_mla:
        raise ManifestError(
            f"kv_cache.dtype: {kv_cache.dtype} latent (MLA) caches are not supported yet",
            hint="leave kv_cache.dtype out: the latent cache is already 71x smaller than K/V",
        )
    if sampling.max_logprobs > model_config.vocab_size:
        raise ManifestError(
            f"sampling.max_logprobs: {sampling.max_logprobs} exceeds the vocabulary "
            f"({model_config.vocab_size} tokens)"
        )
    return Manifest(
        name=display_name,
        model=model_path,
        dtype=dtype,
        target=target,
        neuron=neuron,
        parallel=parallel,
        kv_cache=kv_cache,
        buckets=buckets,
        sampling=sampling,
        compiler=compiler,
        model_config=model_config,
        audit=audit,
        mla_decode=mla_decode,
        decode_state=_choice(
            data.get("decode_state", "device" if target == "neuron" else "host"),
            DECODE_STATES,
            "decode_state",
        ),
    )


def _neuron(data: dict[str, Any], target: str) -> NeuronOptions | None:
    if "neuron" not in data:
        return NeuronOptions() if target == "neuron" else None
    raw = _mapping(data["neuron"], "neuron")
    _no_unknown(raw, ("target", "lnc"), "neuron")
    if target != "neuron":
        raise ManifestError(f"neuron: only valid with target: neuron (target is {target!r})")
    return NeuronOptions(
        target=_choice(raw.get("target", "trn2"), NEURON_TARGETS, "neuron.target"),
        lnc=_positive_int(raw.get("lnc", 2), "neuron.lnc"),
    )


def _parallel(value: Any) -> Parallel:
    raw = _mapping(value, "parallel")
    _no_unknown(raw, ("tp", "ep", "per_rank_artifacts"), "parallel")
    per_rank = _flag(raw.get("per_rank_artifacts", False), "parallel.per_rank_artifacts")
    parallel = Parallel(
        tp=_positive_int(raw.get("tp", 1), "parallel.tp"),
        ep=_positive_int(raw.get("ep", 1), "parallel.ep"),
        per_rank_artifacts=per_rank,
    )
    if parallel.tp % parallel.ep:
        raise ManifestError(f"parallel.ep: {parallel.ep} must divide parallel.tp ({parallel.tp})")
    return parallel


def _mla(value: Any, cfg: ModelConfig) -> str:
    raw = _mapping(value, "mla")
    _no_unknown(raw, ("decode",), "mla")
    if raw and not cfg.is_mla:
        raise ManifestError(f"mla: the model ({cfg.architecture}) has no latent attention")
    return _choice(raw.get("decode", "absorbed"), ("absorbed", "expanded"), "mla.decode")


def _flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ManifestError(f"{path}: expected true or false, got {_describe(value)}")
    return value


def _sampling(value: Any) -> Sampling:
    raw = _mapping(value, "sampling")
    _no_unknown(raw, ("max_top_k", "max_logprobs", "prompt_logprobs"), "sampling")
    return Sampling(
        max_top_k=_positive_int(raw.get("max_top_k", 64), "sampling.max_top_k"),
        max_logprobs=_positive_int(raw.get("max_logprobs", 5), "sampling.max_logprobs"),
        prompt_logprobs=_flag(raw.get("prompt_logprobs", False), "sampling.prompt_logprobs"),
    )


def _buckets(value: Any) -> Buckets:
    raw = _mapping(value, "buckets")
    _no_unknown(raw, ("prefill", "decode", "context", "prefill_batch"), "buckets")
    for key in ("prefill", "decode", "context"):
        if key not in raw:
            raise ManifestError(f"buckets.{key}: required field is missing")
    buckets = Buckets(
        prefill=_bucket_list(raw["prefill"], "buckets.prefill"),
        decode=_bucket_list(raw["decode"], "buckets.decode"),
        context=_bucket_list(raw["context"], "buckets.context"),
        prefill_batch=_bucket_list(raw.get("prefill_batch", [1]), "buckets.prefill_batch"),
    )
    if buckets.prefill_batch[0] != 1:
        raise ManifestError(
            f"buckets.prefill_batch[0]: {buckets.prefill_batch[0]}; the list must start with 1 "
            "(a lone prompt, or one asking for prompt logprobs, prefills in a one-row graph)",
            hint=f"write [1, {', '.join(map(str, buckets.prefill_batch))}]",
        )
    if buckets.prefill[0] > buckets.context[-1]:
        raise ManifestError(
            f"buckets.prefill[0]: {buckets.prefill[0]} exceeds the largest context bucket "
            f"({buckets.context[-1]})"
        )
    return buckets


def _kv_cache(
    value: Any, buckets: Buckets, dtype: str, cfg: ModelConfig, par: ParallelLayout
) -> KVCache:
    raw = _mapping(value, "kv_cache")
    _no_unknown(raw, ("block_size", "num_blocks", "dtype", "memory_mb"), "kv_cache")
    kv_dtype = raw.get("dtype")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ManifestError(
            f"kv_cache.dtype: {kv_dtype!r} is not supported; supported: {', '.join(KV_DTYPES)} "
            "(or leave it out for the model dtype)"
        )
    block_size = _positive_int(raw.get("block_size", 16), "kv_cache.block_size")
    for key in ("prefill", "context"):
        for i, b in enumerate(getattr(buckets, key)):
            if b % block_size:
                raise ManifestError(
                    f"buckets.{key}[{i}]: {b} is not a multiple of kv_cache.block_size "
                    f"({block_size})"
                )
    # Default: every decode row can hold the largest context, plus the reserved null block 0;
    # or as many blocks as a per-rank memory budget holds at the cache dtype's width.
    default_blocks = buckets.context[-1] * buckets.decode[-1] // block_size + 1
    memory_mb = raw.get("memory_mb")
    if memory_mb is not None:
        memory_mb = _positive_int(memory_mb, "kv_cache.memory_mb")
        if "num_blocks" in raw:
            raise ManifestError(
                "kv_cache: give num_blocks or memory_mb, not both",
                hint="memory_mb sizes num_blocks from a per-rank budget",
            )
        per_token = kv_bytes_per_token(cfg, par, kv_dtype or dtype)
        default_blocks = memory_mb * 2**20 // (block_size * per_token)
    num_blocks = _positive_int(raw.get("num_blocks", default_blocks), "kv_cache.num_blocks")
    if buckets.context[-1] > (num_blocks - 1) * block_size:
        raise ManifestError(
            f"kv_cache.num_blocks: {num_blocks} blocks of {block_size} tokens "
            "(block 0 is reserved) "
            f"cannot hold the largest context bucket ({buckets.context[-1]} tokens)",
            hint=f"use num_blocks >= {buckets.context[-1] // block_size + 1}",
        )
    return KVCache(
        block_size=block_size, num_blocks=num_blocks, dtype=kv_dtype, memory_mb=memory_mb
    )


def kv_bytes_per_token(cfg: ModelConfig, par: ParallelLayout, dtype: str) -> int:
    """Cache bytes one token takes on one rank, every layer (K and V; MLA: the latent row)."""
    tensors = cfg.num_layers * (1 if cfg.is_mla else 2)
    return tensors * par.kv_heads_per_rank(cfg) * cfg.kv_width * DTYPE_BYTES[dtype]


def _audit(value: Any) -> Audit:
    raw = _mapping(value, "audit")
    _no_unknown(raw, ("waive",), "audit")
    waive = _string_list(raw.get("waive", []), "audit.waive")
    for i, rule in enumerate(waive):
        if rule not in AUDIT_RULE_IDS:
            raise ManifestError(
                f"audit.waive[{i}]: unknown rule {rule!r}; rules: {', '.join(AUDIT_RULE_IDS)}"
            )
    return Audit(waive=waive)


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: manifest file not found") from exc
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc}") from exc
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not a text file (a manifest is YAML)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: invalid YAML: {exc}") from exc
    manifest = parse_manifest(data, path.parent.resolve(), name=path.stem)
    return _with_source(manifest, path.resolve())


def _with_source(manifest: Manifest, source: Path) -> Manifest:
    from dataclasses import replace

    return replace(manifest, source=source)
