"""The manifest's values (schema 1): frozen dataclasses, every default resolved when parsed.

What downstream reads is what the manifest resolved (the KV cache dtype, num_blocks, the decode
state): nothing after parse_manifest fills in a default again. Imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from neffkit.manifest.lora import Lora
from neffkit.manifest.quantization import WeightQuantization
from neffkit.manifest.task import Embedding
from neffkit.models.config import ModelConfig
from neffkit.models.parallel import Parallelism
from neffkit.targets import fp8_max

SCHEMA_VERSION = 1
# AOTInductor options a manifest may set (compiler.inductor), with their value types.
INDUCTOR_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "max_autotune": bool,
    "epilogue_fusion": bool,
    "cpp.simdlen": int,
    "cpp.threads": int,
    "aot_inductor.debug_compile": bool,
    # g++'s -O for the host code that calls the kernels (the kernels are -O3 either way)
    "aot_inductor.compile_wrapper_opt_level": str,
    "fallback_random": bool,
}
# the string options' allowed values
INDUCTOR_CHOICES: dict[str, tuple[str, ...]] = {
    "aot_inductor.compile_wrapper_opt_level": ("O0", "O1", "O2", "O3", "Os"),
}


KV_DTYPES = ("float8_e4m3fn",)  # beside the model dtype (the default)


@dataclass(frozen=True)
class KVCache:
    block_size: int
    num_blocks: int
    # the cache tensors' dtype, resolved here: the model dtype unless the manifest says
    # float8_e4m3fn (clamp(x / k_scale, ±M) stored, M the target's fp8 range (targets.fp8_max),
    # k_scale/v_scale per layer from the checkpoint, else calibrated at build time
    # (compile/calibrate.py), else 1.0)
    dtype: str
    # num_blocks from a per-rank memory budget (MiB) instead, sized by the cache dtype's width
    memory_mb: int | None = None
    # full prompt blocks shared across requests (a runtime choice: no graph changes; `neffkit
    # run --no-prefix-caching` turns it off for one server)
    prefix_caching: bool = True
    # fp8: per-layer K/V scales measured on a calibration text when the checkpoint has none
    calibrate: bool = True
    # fp8 with calibrated scales: keys stored less a calibrated offset at their position,
    # weighted per channel and rotated by a Hadamard matrix, queries alike, the offset's
    # product added back (kernels/kv.py); None: on wherever it applies
    rotate_keys: bool | None = None
    # sliding-window layers in KV groups of their own, window-sized (contract/kv_groups.py);
    # false: every layer keeps the whole context in one pool (vLLM's
    # --disable-hybrid-kv-cache-manager)
    hybrid: bool = True


@dataclass(frozen=True)
class Buckets:
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    context: tuple[int, ...]
    # rows of a prefill graph: several waiting prompts' chunks in one call (packing a burst of
    # arrivals); 1 always, since a lone prompt runs cheapest alone
    prefill_batch: tuple[int, ...] = (1,)
    # context buckets past the checkpoint's max_position_embeddings (or its rope scaling's
    # extended length) are refused unless the manifest says the model handles them
    allow_long_context: bool = False


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
    # the sampling graphs take a token bitmask (structured outputs: JSON schemas, regexes,
    # choices, grammars, forced tool calls); false builds them without it
    structured: bool = True
    # presence / frequency / repetition penalties track up to N distinct prompt and output tokens
    # a request (None: the largest context bucket, which any request fits; 0: no penalties)
    max_penalty_tokens: int | None = None
    # logit_bias entries a request, min_tokens' stop tokens included (0: neither)
    max_logit_bias: int = 300

    def penalty_tokens(self, context: int, vocab: int) -> int:
        """Penalty pairs per row, resolved against the largest context bucket."""
        n = context if self.max_penalty_tokens is None else self.max_penalty_tokens
        return min(n, vocab)


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


SPECULATION_METHODS = ("ngram", "draft", "mtp")


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding: verify graphs of 1 + num_tokens tokens a row (the last token and K
    proposed ones), for the decode buckets up to max_batch; the drafts come from `method`
    ("ngram": prompt lookup on the host, the longest suffix of prompt_lookup_max down to
    prompt_lookup_min tokens found earlier in the sequence proposes what followed it; "draft":
    a smaller checkpoint sharing the target's vocabulary, `model`, built into the same bundle
    with graphs and a KV cache of its own, proposing K tokens greedily; "mtp": the checkpoint's
    own multi-token prediction layer, built the same way from the target's hidden states)."""

    method: str
    num_tokens: int
    max_batch: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: Path | None = None  # methods draft and mtp: the proposer's checkpoint directory
    model_config: ModelConfig | None = None  # ... and its config (mtp: the MTP layer's)


@dataclass(frozen=True)
class Manifest:
    name: str
    model: Path
    dtype: str
    target: str
    neuron: NeuronOptions | None
    parallel: Parallelism
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
    speculation: Speculation | None = None
    # the LM head's bundle dtype where it differs from `dtype`: float8_e4m3fn quantizes it at
    # build time with the fp8 checkpoint's own scale blocks (llama.cpp's Q8_0 quantizes its
    # output tensor too); a tied head gets an fp8 copy beside the embedding table
    lm_head_dtype: str | None = None
    # the commit of a model read from a Hugging Face cache (`model: org/name[@revision]`, or a
    # snapshot directory): which weights the bundle was built from (manifest/hub.py)
    model_revision: str | None = None
    # the manifest's weight quantization of a float checkpoint (manifest/quantization.py)
    quantization: WeightQuantization | None = None
    # adapter slots in every graph (manifest/lora.py); None: graphs without adapters
    lora: Lora | None = None
    # task embed: prefill graphs returning pooled hidden states (manifest/task.py); None: generate
    embedding: Embedding | None = None

    @property
    def task(self) -> str:
        return "generate" if self.embedding is None else "embed"

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
        data["task"] = self.task
        data["model"] = str(self.model)
        spec = data.get("speculation")
        if spec is not None:  # the draft checkpoint as a path; its config is the draft's own
            spec.pop("model_config")
            spec["model"] = str(spec["model"]) if spec["model"] is not None else None
        return data
