"""How one request samples and when it stops: the value the scheduler, the engine core and the
offline `LLM` take (vLLM's `sampling_params.py`), apart from the OpenAI request parsing in
protocol.py, so the engine imports nothing of HTTP.

`SamplingParams` checks itself when it is made (as vLLM's `_verify_args` does) and names the field
at fault, so the server, the offline CLI and the engine core share one set of rules; what depends
on the bundle (prompt length against the context buckets, KV blocks) is the scheduler's check
(`limits.check_fits`). Errors are RequestErrors carrying the field in `param`. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from neffkit.errors import RequestError

# Defaults, one place. The API's are OpenAI's (and vLLM's): a request that omits a field.
DEFAULT_MAX_TOKENS = 16  # /v1/completions; chat leaves it unset: up to the context limit
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0  # <= 0 (or -1): no top-k; with top_p 1, the whole vocabulary
# `neffkit run --prompt` is a check a person reads: greedy (reproducible) and a little longer
OFFLINE_MAX_TOKENS = 32
OFFLINE_TEMPERATURE = 0.0

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the graphs read sampling values as float32
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range; vLLM (and the parser here) clamp finite biases to it
# What one request may ask to be stopped by. vLLM has no hard limits; these are far above what
# clients send (OpenAI takes 4 stop strings, lm-eval a handful) and keep a request's cost bounded:
# every generated token is checked against each stop string (and the text held back for a partial
# match is as long as the longest), and min_tokens writes each stop id into the graph's bias pairs.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: Any, text: str | None = None) -> str:
    """A request value (or its `text`) for an error message, short whatever its size."""
    if text is None and is_int(value) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if text is None else text
    return text if len(text) <= 64 else f"{text[:48]}… ({len(text)} characters)"


def check_int(value: Any, name: str, lo: int = 0, hi: int = INT64_MAX) -> None:
    """An integer within [lo, hi] (a JSON true is not one), else a RequestError naming `name`:
    every integer a request gives reaches a graph's int64 input, an index or a loop bound."""
    if is_int(value) and lo <= value <= hi:
        return
    if (lo, hi) == (INT64_MIN, INT64_MAX):
        wanted = "a 64-bit integer"
    elif hi == INT64_MAX:
        wanted = f">= {lo}, a 64-bit integer"
    else:
        wanted = f"an integer in [{lo}, {hi}]"
    param = name.split("[")[0]
    raise RequestError(f"{name} must be {wanted}, got {shown(value)}", param=param)


# what a grammar may be given as (structured.py compiles them with llguidance)
GRAMMAR_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """A request's output constraint: a JSON schema (text), a regex, a JSON list of choices, or
    a Lark / GBNF grammar; `field` is the request field it came from (errors name it)."""

    kind: str
    source: str
    field: str = "structured_outputs"
    # JSON: any whitespace between tokens (vLLM's default); False: compact JSON, no whitespace
    # (vLLM's disable_any_whitespace), which keeps small models from wandering in whitespace;
    # None: the server's default (--disable-any-whitespace), else True
    any_whitespace: bool | None = None
    # the field a schema that does not compile is blamed on, where it is not `field` (a tool
    # choice's schema comes from `tools`)
    schema_field: str = ""
    # a reasoning parser's end token (`</think>`): the grammar applies to the tokens after it,
    # those up to it unconstrained (vLLM's rule), unless the prompt holds it already; None: all
    after_token: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops; validated on construction."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: up to the largest context bucket
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # per output token: its logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # vLLM's / OpenAI's logit processing (kernels/logits.py): penalties over the output tokens
    # (repetition: over the prompt's too), biases by token id, EOS and stop tokens banned until
    # min_tokens are out, and a grammar the output must follow
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredSpec | None = None

    @property
    def penalized(self) -> bool:
        """Any penalty set: the request needs the graphs' penalty inputs."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )

    def __post_init__(self) -> None:
        # 0 generates nothing: a prompt's own logprobs (echo), what lm-eval's loglikelihood asks
        if self.max_tokens is not None:
            check_int(self.max_tokens, "max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise RequestError(
                f"temperature must be >= 0 and finite, got {self.temperature}", param="temperature"
            )
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        check_int(self.top_k, "top_k", INT64_MIN)
        if self.seed is not None:
            check_int(self.seed, "seed", INT64_MIN)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(
                f"stop_token_ids: {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
                param="stop_token_ids",
            )
        for i, token in enumerate(self.stop_token_ids):  # the vocabulary: limits.check_fits
            check_int(token, f"stop_token_ids[{i}]")
        self._check_processing()

    def _check_processing(self) -> None:
        """vLLM's ranges: penalties in [-2, 2] and > 0, biases in [-100, 100] (the parser clamps
        finite ones to it), min_tokens within max_tokens."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {value}", param=name)
        if not 0.0 < self.repetition_penalty <= FLOAT32_MAX:
            value = self.repetition_penalty
            raise RequestError(
                f"repetition_penalty must be > 0 and finite, got {value}",
                param="repetition_penalty",
            )
        check_int(self.min_tokens, "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        for token, bias in self.logit_bias:
            check_int(token, "logit_bias")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:  # NaN too
                raise RequestError(
                    f"logit_bias[{token}]: the bias must be a number in [-{LOGIT_BIAS_LIMIT:g}, "
                    f"{LOGIT_BIAS_LIMIT:g}], got {shown(bias)}",
                    param="logit_bias",
                )
        spec = self.structured
        if spec is not None and spec.kind not in GRAMMAR_KINDS:
            raise RequestError(f"unknown constraint kind {spec.kind!r}", param=spec.field)


OFFLINE = SamplingParams(max_tokens=OFFLINE_MAX_TOKENS, temperature=OFFLINE_TEMPERATURE)
# an embed bundle's request: its prompt prefilled and pooled, nothing generated
EMBED = SamplingParams(max_tokens=0, temperature=0.0)
