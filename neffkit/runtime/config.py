"""What a bundle can serve, as the runtime reads it (buckets, KV blocks, sampling limits), and the
bucket rule: the smallest bucket that fits. Shared by every room of the runtime; imports only the
contract."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

from neffkit.contract.kv_groups import KVGroup
from neffkit.contract.records import BundleRecord, LayoutRecord, ModelRecord, SpeculationRecord
from neffkit.errors import NeffkitError

POLICIES = ("fcfs", "priority")  # --scheduling-policy (engine/policy.py)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's view of a bundle: what its layout records (buckets, KV blocks, sampling
    limits) and its model's end-of-sequence ids and vocabulary, read through and never copied,
    and what this engine turned off (prefix caching, speculation)."""

    layout: LayoutRecord
    model: ModelRecord
    prefix_caching: bool = True  # full prompt blocks shared across requests (kv_blocks.py)
    speculation: SpeculationRecord | None = None  # verify graphs in the bundle (spec_decode/)
    policy: str = "fcfs"  # who waits and who is preempted (engine/policy.py)
    blocks_override: int | None = None  # fewer KV blocks than the bundle's (null block included)

    @classmethod
    def of(cls, record: BundleRecord) -> SchedulerConfig:
        lay = record.layout
        return cls(lay, record.model, lay.prefix_caching, lay.speculation)

    @property
    def block_size(self) -> int:  # tokens per KV block
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:  # block 0 included (the null block, never handed out)
        return self.blocks_override or self.layout.num_blocks

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The KV groups the scheduler allocates from (contract/kv_groups.py); an override
        sizes the first group's pool."""
        first, *rest = self.layout.groups
        return (replace(first, num_blocks=self.num_blocks), *rest)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:  # tokens per prefill chunk
        return self.layout.buckets.prefill

    @property
    def decode_buckets(self) -> tuple[int, ...]:  # sequences per decode step
        return self.layout.buckets.decode

    @property
    def context_buckets(self) -> tuple[int, ...]:  # tokens attended; the largest: max_model_len
        return self.layout.buckets.context

    @property
    def prefill_batch(self) -> tuple[int, ...]:  # rows per prefill call (packed prompts)
        return self.layout.buckets.prefill_batch

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model.eos_token_ids

    @property
    def vocab_size(self) -> int:  # prompt token ids must lie in [0, vocab_size)
        return self.model.vocab_size

    @property
    def max_top_k(self) -> int:  # the bundle's candidates for top-k / top-p
        return self.layout.max_top_k

    @property
    def max_logprobs(self) -> int:  # top logprobs the graphs return per token
        return self.layout.max_logprobs

    @property
    def prompt_logprobs(self) -> bool:  # prefill graphs return the prompt's own logprobs
        return self.layout.prompt_logprobs

    @property
    def bitmask_words(self) -> int:  # the sampling graphs' logit inputs (0: none)
        return self.layout.bitmask_words

    @property
    def penalty_tokens(self) -> int:
        return self.layout.penalty_tokens

    @property
    def bias_tokens(self) -> int:
        return self.layout.bias_tokens

    @property
    def max_model_len(self) -> int:
        return self.context_buckets[-1]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class SchedulingOptions:
    """How an engine schedules its bundle (`neffkit run` flags, vLLM's): `policy` (fcfs or
    priority) and `num_blocks`, a KV pool smaller than the bundle's (vLLM's
    --num-gpu-blocks-override; the null block included, as vLLM counts)."""

    policy: str = "fcfs"
    num_blocks: int | None = None

    def apply(self, config: SchedulerConfig) -> SchedulerConfig:
        if self.policy not in POLICIES:
            raise NeffkitError(f"--scheduling-policy {self.policy!r}: one of {', '.join(POLICIES)}")
        built = config.layout.num_blocks
        if self.num_blocks is not None and not 2 <= self.num_blocks <= built:
            raise NeffkitError(
                f"--num-gpu-blocks-override {self.num_blocks}: this bundle's KV cache holds "
                f"{built} blocks (the null block included); give 2 to {built}"
            )
        return replace(config, policy=self.policy, blocks_override=self.num_blocks)


def smallest_fitting(buckets: Sequence[int], need: int) -> int | None:
    """The smallest bucket of `buckets` (ascending) that holds `need`, or None."""
    i = bisect.bisect_left(buckets, need)
    return buckets[i] if i < len(buckets) else None
