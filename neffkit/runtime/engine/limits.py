"""What a bundle can serve (its buckets, blocks and sampling limits, as the scheduler sees them)
and what a request may ask of it: checked before a request is queued, so one no bucket can serve
is a 400 naming the field, not a failed sequence (the server and offline runs alike)."""

from __future__ import annotations

from neffkit.errors import RequestError
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.sampling_params import SamplingParams, shown
from neffkit.runtime.worker.logit_inputs import Penalties, stop_count


def output_budget(config: SchedulerConfig, prompt_len: int, params: SamplingParams) -> int:
    """Tokens a request may generate: its max_tokens, or (unset) up to the largest context."""
    if params.max_tokens is not None:
        return params.max_tokens
    return config.max_model_len - prompt_len


def check_fits(config: SchedulerConfig, prompt_ids: list[int], params: SamplingParams) -> None:
    """Refuse what no bucket can serve, with the buckets in the message."""
    if not prompt_ids:
        raise RequestError("prompt is empty: at least one token is needed", param="prompt")
    if config.layout.pooling is not None and params.max_tokens != 0:
        raise RequestError(
            "this bundle computes embeddings (task: embed) and generates no tokens",
            hint="POST /v1/embeddings, or build a bundle with task: generate",
            param="model",
        )
    _check_vocabulary(config, prompt_ids, params)
    cap = config.max_top_k
    if params.top_k > cap:
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
    for g, group in enumerate(config.groups):  # alone in the pool: every group's blocks
        need = min(config.blocks_for(total), group.blocks_per_seq)
        if need > group.num_blocks - 1:
            where = "" if len(config.groups) == 1 else f" (KV group {g})"
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({budget}) needs "
                f"{need} KV blocks of {config.block_size} tokens; the KV pool{where} "
                f"holds {group.num_blocks - 1}",
                hint="shorten the prompt or lower max_tokens (a request must fit the pool alone)",
                param="prompt",
            )


def check_priority(policy: str, priority: int) -> None:
    """A priority means something only under the priority policy (vLLM refuses it too)."""
    if priority and policy != "priority":
        raise RequestError(
            f"priority {shown(priority)}: this server schedules first come, first served",
            hint="start it with --scheduling-policy priority, or leave priority out",
            param="priority",
        )


def _check_vocabulary(
    config: SchedulerConfig, prompt_ids: list[int], params: SamplingParams
) -> None:
    """Every token id a request gives lies in [0, vocab): the prompt's (an embedding gather),
    the stop ids and logit_bias keys (bias pairs the graph scatters into the logits)."""
    vocab = config.vocab_size
    fields = (
        ("prompt", prompt_ids),
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    )
    for field, ids in fields:
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            where = field if field == "logit_bias" else f"{field}[{bad}]"
            raise RequestError(
                f"{where}: token id {shown(ids[bad])} is outside the vocabulary [0, {vocab})",
                param=field,
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
    pairs = len(params.logit_bias) + stop_count(params, config.eos_token_ids)
    if pairs > config.bias_tokens:
        field = "logit_bias" if params.logit_bias else "min_tokens"
        raise RequestError(
            f"{field}: {pairs} biased tokens (logit_bias entries, and min_tokens' EOS and stop "
            f"tokens); this bundle takes {config.bias_tokens} (sampling.max_logit_bias)",
            hint="send fewer, or build with a larger sampling.max_logit_bias",
            param=field,
        )
