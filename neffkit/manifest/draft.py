"""A draft model's manifest, derived from the target's (speculation.method: draft).

The draft is built as a bundle of its own inside the target's (`draft/`), with the graphs its
proposer runs: prefill graphs of the target's buckets (it prefills every prompt chunk the target
does, so its KV cache holds the same positions in the same blocks), decode graphs up to the
speculation's max_batch (one greedy draft token a step) and verify-shaped graphs of 1 + K tokens
(catching up on the tokens the target accepted since its last step). The KV cache has the
target's block size and block count: one block table addresses both caches.
"""

from __future__ import annotations

from dataclasses import replace

from neffkit.manifest.schema import Manifest, Sampling, Speculation
from neffkit.models.parallel import Parallelism


def draft_manifest(manifest: Manifest) -> Manifest:
    """The draft model's manifest: the target's dtype, target, compiler and KV blocks (one
    pool, whatever its windows); greedy sampling only (one candidate, one logprob); host decode
    state (the proposer sends its own tokens each step); no adapters."""
    spec = manifest.speculation
    if spec is None or spec.model is None or spec.model_config is None:
        raise ValueError(f"{manifest.name}: no draft model in this manifest")
    b = manifest.buckets
    return replace(
        manifest,
        name=f"{manifest.name}-draft",
        model=spec.model,
        model_config=spec.model_config,
        parallel=Parallelism(),
        # one pool over the whole context: the draft's cache follows the target's one block
        # table (a target with sliding KV groups takes no draft model: compile/layout.py)
        kv_cache=replace(manifest.kv_cache, memory_mb=None, hybrid=False),
        buckets=replace(b, decode=tuple(n for n in b.decode if n <= spec.max_batch)),
        # proposals are greedy: no grammar, penalties or biases (rows with them get no drafts)
        sampling=Sampling(
            max_top_k=1,
            max_logprobs=1,
            prompt_logprobs=False,
            structured=False,
            max_penalty_tokens=0,
            max_logit_bias=0,
        ),
        mla_decode=manifest.mla_decode if spec.method == "mtp" else "absorbed",
        decode_state="host",
        lm_head_dtype=None,  # the draft's checkpoint keeps its own head
        speculation=Speculation("ngram", spec.num_tokens, spec.max_batch),
        lora=None,  # drafts are the base model's: the target's verify graphs apply adapters
        source=None,
    )
