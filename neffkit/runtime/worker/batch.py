"""A request as the worker and the proposers see it, and the batches the scheduler hands the runner.

`SequenceState` is the scheduler's record of one request (tokens, blocks, sampling values, the
logit-processing and speculation state that changes as it generates); `PrefillBatch` and
`DecodeBatch` are one step's choice of rows and buckets. They live here, below the engine, so the
runner and the speculative proposers read them without importing the scheduler (vLLM keeps its
`CachedRequestState` in the worker's input batch for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neffkit.contract.records import PoolingRecord
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.worker.logit_inputs import Penalties
from neffkit.runtime.worker.pooled import PooledState
from neffkit.runtime.worker.step_output import StepOutput, TokenLogprobs


@dataclass
class DraftState:
    """A sequence's speculation history: consecutive all-rejected steps and a pause; with a draft
    model, the positions its KV cache holds and the drafts written past them."""

    misses: int = 0
    paused: int = 0
    computed: int = 0  # draft model: positions 0 .. computed - 1 are in its cache
    speculated: list[int] = field(default_factory=list)  # drafts whose K/V follows them
    # MTP: the target's hidden states at positions computed, computed + 1, ... (not yet fed to
    # the MTP layer), and the MTP layer's last (token, hidden state) output
    hidden: list[Any] = field(default_factory=list)
    head: tuple[int, Any] | None = None
    stopped: bool = False  # MTP: too far behind its target to catch up; it decodes plainly


@dataclass
class SequenceState:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    # its blocks in each KV group (engine/group_blocks.py), by logical block: 0 where a
    # sliding group gave one back
    kv_blocks: list[list[int]] = field(default_factory=list)
    state_slot: int = 0  # its slot in the device decode state while admitted (0: none)
    num_prefilled: int = 0
    num_cached: int = 0  # prompt tokens found in the prefix cache at admission (not computed)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks so far
    num_registered: int = 0  # its leading blocks that are in the prefix cache
    finish_reason: str | None = None
    # with params.logprobs: one entry per output token
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs: one entry per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    drafting: DraftState = field(default_factory=DraftState)  # speculation's back-off
    # with penalties: its distinct tokens and output counts (logit_inputs.py)
    penalties: Penalties | None = None
    # with a constraint: its grammar matcher (structured.py), advanced by each output token
    grammar: Any = None
    # a constraint that applies after the reasoning (StructuredSpec.after_token): that token,
    # until it is sampled; the grammar neither masks nor consumes the tokens up to it
    grammar_after: int | None = None
    # with an adapter (bundles with `lora:`): its name, the key its blocks are hashed with (one
    # per registration of the name: engine/adapters.py) and its slot once admitted (0: base)
    adapter: str | None = None
    adapter_key: str | None = None
    lora_slot: int = 0
    priority: int = 0  # --scheduling-policy priority: lower first, ties by arrival (request_id)
    preemptions: int = 0  # times its blocks were taken back; it recomputed its tokens after each
    # an embed bundle's request: its chunks' pooled states so far (pooled.py), then its embedding
    pooled: PooledState | None = None
    embedding: Any = None  # np.ndarray [width] float32, once its last chunk is in

    @property
    def blocks(self) -> list[int]:
        """Its blocks in the first KV group (the only one of most bundles)."""
        return self.kv_blocks[0] if self.kv_blocks else []

    @blocks.setter
    def blocks(self, blocks: list[int]) -> None:
        self.kv_blocks = [blocks, *self.kv_blocks[1:]]

    def pool(self, row: Any, start: int, rule: PoolingRecord | None) -> None:
        """Add the pooled row of its chunk from `start` (an embed bundle's request)."""
        assert rule is not None  # only embed bundles' graphs return pooled states
        if self.pooled is None:
            self.pooled = PooledState(rule)
        self.pooled.add(row, start)

    @property
    def active_grammar(self) -> Any:
        """The grammar that masks its next token: none while it waits for the reasoning's end."""
        return self.grammar if self.grammar_after is None else None

    @property
    def processes_logits(self) -> bool:
        """Penalties, biases or min_tokens: its logit inputs change as it generates."""
        p = self.params
        return self.penalties is not None or bool(p.logit_bias) or p.min_tokens > 0

    @property
    def may_draft(self) -> bool:
        """A verify graph gives a row's values to every position: exact unless they change from
        token to token (penalty counts, min_tokens until reached, a grammar's state)."""
        fixed = self.penalties is None and self.grammar is None
        return fixed and len(self.output_ids) >= self.params.min_tokens

    @property
    def max_tokens(self) -> int:
        """Its output budget: the engine resolves an unset max_tokens before it queues it."""
        if self.params.max_tokens is None:
            raise ValueError(f"request {self.request_id} was queued without a max_tokens")
        return self.params.max_tokens

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens a prefill computes: the prompt; after a preemption, the prompt and the
        tokens generated so far (recomputed: the same K/V, then the next token, drawn with
        the same seed at the same position, so outputs do not change)."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(
        self,
        token: int,
        out: StepOutput,
        row: int,
        eos_token_ids: tuple[int, ...],
        position: int | None = None,
    ) -> None:
        """Add `token` (sampled at row `row`, a verify step's at `position` of it): counted for
        penalties, consumed by the grammar, its logprobs kept; `finish_reason` is set where it
        ends the request (a grammar complete or refusing it, EOS, a stop token, max_tokens)."""
        self.output_ids.append(token)
        params = self.params
        if self.penalties is not None:
            self.penalties.add(token)
        if self.grammar_after is not None:  # the reasoning: unconstrained up to its end
            self.grammar_after = None if token == self.grammar_after else self.grammar_after
        elif self.grammar is not None:
            if not self.grammar.consume_token(token):
                self.finish_reason = "error"  # the graph sampled what the mask forbade
            elif self.grammar.is_stopped():  # complete, nothing may follow: done, EOS or not
                self.finish_reason = "stop"
            if self.finished:
                return
        if params.logprobs is not None:
            self.output_logprobs.append(out.logprobs(row, params.logprobs, position))
        if not params.ignore_eos and token in eos_token_ids:
            self.finish_reason = "stop"
        elif token in params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_tokens:
            self.finish_reason = "length"


@dataclass(frozen=True)
class PrefillChunk:
    """`length` prompt tokens of `seq` from `start`: one sequence of a prefill call."""

    seq: SequenceState
    start: int
    length: int


@dataclass(frozen=True)
class PrefillBatch:
    """Chunks of distinct prompts packed into the one row of the (batch, tokens, context)
    prefill graph: `batch` sequences (those past the chunks pad), `tokens` tokens in all."""

    chunks: list[PrefillChunk]
    batch: int
    tokens: int
    context: int


@dataclass(frozen=True)
class DecodeBatch:
    """One token for each of `rows`, in the (batch, context) decode graph; rows past them pad.
    With `drafts` (speculation), the (batch, K, context) verify graph instead: each row's last
    token and its drafts (fewer than K: the rest pad)."""

    rows: list[SequenceState]
    batch: int
    context: int
    drafts: list[list[int]] | None = None
