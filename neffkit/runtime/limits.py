"""What a bundle can serve (its buckets, blocks and sampling limits, as the scheduler sees them)
and what a request may ask of it: checked before a request is queued, so one no bucket can serve
is a 400 naming the field, not a failed sequence (the server and offline runs alike)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from neffkit.contract.records import BundleRecord, SpeculationRecord
from neffkit.errors import RequestError
from neffkit.runtime.logit_inputs import Penalties, stop_count
from neffkit.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's view of a bundle: buckets, KV blocks, end-of-sequence ids."""

    block_size: int  # tokens per KV block
    num_blocks: int  # block 0 included (the null block, never handed out)
    prefill_buckets: tuple[int, ...]  # tokens per prefill chunk
    decode_buckets: tuple[int, ...]  # sequences per decode step
    context_buckets: tuple[int, ...]  # tokens attended; the largest is max_model_len
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # prompt token ids must lie in [0, vocab_size)
    max_top_k: int | None = None  # the bundle's candidates for top-k / top-p (None: no limit)
    max_logprobs: int = 0  # top logprobs the graphs return per token
    prompt_logprobs: bool = False  # prefill graphs return the prompt's own logprobs
    prefill_batch: tuple[int, ...] = (1,)  # rows per prefill call (packed prompts)
    prefix_caching: bool = True  # full prompt blocks shared across requests (kv_blocks.py)
    speculation: SpeculationRecord | None = None  # verify graphs in the bundle (speculation.py)
    # the sampling graphs' logit inputs (0: none): grammar bitmask words, penalty and bias pairs
    bitmask_words: int = 0
    penalty_tokens: int = 0
    bias_tokens: int = 0

    @classmethod
    def of(cls, record: BundleRecord) -> SchedulerConfig:
        lay = record.layout
        return cls(
            block_size=lay.block_size,
            num_blocks=lay.num_blocks,
            prefill_buckets=lay.buckets.prefill,
            decode_buckets=lay.buckets.decode,
            context_buckets=lay.buckets.context,
            eos_token_ids=record.model.eos_token_ids,
            vocab_size=record.model.vocab_size,
            max_top_k=lay.max_top_k,
            max_logprobs=lay.max_logprobs,
            prompt_logprobs=lay.prompt_logprobs,
            prefill_batch=lay.buckets.prefill_batch,
            prefix_caching=lay.prefix_caching,
            speculation=lay.speculation,
            bitmask_words=lay.bitmask_words,
            penalty_tokens=lay.penalty_tokens,
            bias_tokens=lay.bias_tokens,
        )

    @property
    def max_model_len(self) -> int:
        return self.context_buckets[-1]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def smallest_fitting(buckets: Sequence[int], need: int) -> int | None:
    """The smallest bucket of `buckets` (ascending) that holds `need`, or None."""
    i = bisect.bisect_left(buckets, need)
    return buckets[i] if i < len(buckets) else None


def output_budget(config: SchedulerConfig, prompt_len: int, params: SamplingParams) -> int:
    """Tokens a request may generate: its max_tokens, or (unset) up to the largest context."""
    if params.max_tokens is not None:
        return params.max_tokens
    return config.max_model_len - prompt_len


def check_fits(config: SchedulerConfig, prompt_ids: list[int], params: SamplingParams) -> None:
    """Refuse what no bucket can serve, with the buckets in the message."""
    if not prompt_ids:
        raise RequestError("prompt is empty: at least one token is needed", param="prompt")
    bad = next((i for i, t in enumerate(prompt_ids) if not 0 <= t < config.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"prompt[{bad}]: token id {prompt_ids[bad]} is outside the vocabulary "
            f"[0, {config.vocab_size})",
            param="prompt",
        )
    cap = config.max_top_k
    if cap is not None and params.top_k > cap:
        raise RequestError(
            f"top_k {params.top_k} exceeds this bundle's sampling candidates "
            f"(sampling.max_top_k: {cap})",
            hint="ask for top_k <= that, or build with a larger sampling.max_top_k",
            param="top_k",
        )
    _check_logprobs(config, params)
    budget = output_budget(config, len(prompt_ids), params)
    budget = budget if params.max_tokens == 0 else max(budget, 1)  # 0: prompt logprobs only
    _check_logit_processing(config, prompt_ids, params, budget)
    total = len(prompt_ids) + budget
    if total > config.max_model_len:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({budget}) = {total} "
            f"exceeds the largest context bucket ({config.max_model_len}); context buckets: "
            f"{list(config.context_buckets)}",
            hint="shorten the prompt, lower max_tokens, or build with a larger context bucket",
            param="prompt",
        )
    if config.blocks_for(total) > config.num_blocks - 1:
        raise RequestError(
            f"request needs {config.blocks_for(total)} KV blocks; the bundle has "
            f"{config.num_blocks - 1}",
            param="prompt",
        )


def _check_logprobs(config: SchedulerConfig, params: SamplingParams) -> None:
    for top in (params.logprobs, params.prompt_logprobs):
        if top is not None and top > config.max_logprobs:
            raise RequestError(
                f"logprobs {top} exceeds this bundle's sampling.max_logprobs "
                f"({config.max_logprobs})",
                hint="ask for fewer, or build with a larger sampling.max_logprobs",
                param="logprobs",
            )
    if params.prompt_logprobs is not None and not config.prompt_logprobs:
        raise RequestError(
            "prompt logprobs (echo with logprobs) need a bundle built with "
            "sampling.prompt_logprobs: true",
            param="echo",
        )


def _check_logit_processing(
    config: SchedulerConfig, prompt_ids: list[int], params: SamplingParams, budget: int
) -> None:
    """What the bundle's logit inputs can carry: a grammar needs the bitmask, penalties their
    pairs (every distinct token the request can see), biases and min_tokens theirs."""
    spec = params.structured
    if spec is not None and not config.bitmask_words:
        raise RequestError(
            f"{spec.field}: this bundle was built without the token bitmask structured outputs "
            "need (sampling.structured: false)",
            hint="build with sampling.structured: true (the default)",
            param=spec.field,
        )
    if params.penalized:
        need = Penalties.bound(params, prompt_ids, budget)
        if need > config.penalty_tokens:
            name = (
                "repetition_penalty"
                if params.repetition_penalty != 1.0
                else "frequency_penalty"
                if params.frequency_penalty
                else "presence_penalty"
            )
            raise RequestError(
                f"{name}: this request may see {need} distinct tokens; the bundle's penalties "
                f"track {config.penalty_tokens} (sampling.max_penalty_tokens)",
                hint="lower max_tokens, or build with a larger sampling.max_penalty_tokens",
                param=name,
            )
    for t, _ in params.logit_bias:
        if t >= config.vocab_size:
            raise RequestError(
                f"logit_bias: token id {t} is outside the vocabulary [0, {config.vocab_size})",
                param="logit_bias",
            )
    pairs = len(params.logit_bias) + stop_count(params, config.eos_token_ids)
    if pairs > config.bias_tokens:
        field = "logit_bias" if params.logit_bias else "min_tokens"
        raise RequestError(
            f"{field}: {pairs} biased tokens (logit_bias entries, and min_tokens' EOS and stop "
            f"tokens); this bundle takes {config.bias_tokens} (sampling.max_logit_bias)",
            hint="send fewer, or build with a larger sampling.max_logit_bias",
            param=field,
        )
