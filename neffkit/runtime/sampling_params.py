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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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

    def __post_init__(self) -> None:
        # 0 generates nothing: a prompt's own logprobs (echo), what lm-eval's loglikelihood asks
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise RequestError(
                f"max_tokens must be >= 0, got {self.max_tokens!r}", param="max_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise RequestError(f"{name} must be >= 0, got {value!r}", param=name)
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise RequestError(
                f"temperature must be >= 0 and finite, got {self.temperature}", param="temperature"
            )
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not is_int(self.top_k) or not INT64_MIN <= self.top_k <= INT64_MAX:
            raise RequestError(f"top_k must be a 64-bit integer, got {self.top_k!r}", param="top_k")
        if self.seed is not None and not (
            is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise RequestError(f"seed must be a 64-bit integer, got {self.seed!r}", param="seed")
        if not all(is_int(t) for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be a list of integers", param="stop_token_ids")


OFFLINE = SamplingParams(max_tokens=OFFLINE_MAX_TOKENS, temperature=OFFLINE_TEMPERATURE)
