"""Offline generation (`neffkit run --prompt`): prompts in, outputs and timings out.

`LLM` runs prompts to completion together on one loaded bundle (continuous batching through the
engine core), as vLLM's `LLM.generate` does; `generate` is the CLI's entry point, which also
starts the other ranks of a multi-rank bundle.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neffkit.errors import AdapterError, RequestError
from neffkit.runtime.config import SchedulingOptions
from neffkit.runtime.engine.adapters import adapter_manager
from neffkit.runtime.engine.core import EngineCore, engine_threads
from neffkit.runtime.engine.governor import default_governor
from neffkit.runtime.engine.limits import check_fits, check_priority
from neffkit.runtime.engine.loading import attach_proposer, grammars_of
from neffkit.runtime.sampling_params import EMBED, OFFLINE, SamplingParams
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.distributed import DEFAULT_TIMEOUT_S, run_on_ranks
from neffkit.runtime.worker.loader import LoadedBundle


class LLM:
    """Generation over one loaded bundle. One engine per loaded bundle at a time: engines on one
    bundle share its KV cache, so one's cached prefix blocks may be another's fresh ones."""

    def __init__(
        self,
        loaded: LoadedBundle,
        prefix_caching: bool = True,
        speculation: bool = True,
        lora_modules: Mapping[str, str | Path] | None = None,
        max_cpu_loras: int | None = None,
        scheduling: SchedulingOptions | None = None,
        threads: int | None = None,
    ) -> None:
        """`lora_modules`: adapters by name (PEFT directories), for a bundle built with `lora:`;
        more can be added with `load_lora`. `scheduling`: the policy, a smaller KV pool.
        `threads`: the engine's (None: every usable CPU, one fewer while another process takes
        a core, as the server's engine: governor.py)."""
        import torch

        ranks = loaded.bundle.record.layout.world_size
        governor = None
        if ranks == 1:  # ranks > 1 split the CPUs between them (worker/distributed.py)
            full = engine_threads(threads)
            torch.set_num_threads(full)
            governor = default_governor(threads, full, ranks)
        self.loaded = attach_proposer(loaded)
        self.adapters = adapter_manager(loaded, lora_modules or {}, max_cpu_loras)
        self.core = EngineCore(
            loaded.runner,
            prefix_caching,
            speculation,
            grammars=grammars_of(loaded),
            adapters=self.adapters,
            scheduling=scheduling,
            governor=governor,
        )

    def load_lora(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter at `path` as `name` (AdapterError: it cannot be served)."""
        if self.adapters is None:
            raise AdapterError(f"{self.loaded.bundle.root}: built without adapter slots (lora:)")
        self.adapters.register(name, path)

    @property
    def embeds(self) -> bool:
        """An embed bundle (task: embed): `embed`, not `generate`."""
        return self.core.scheduler.config.layout.pooling is not None

    def embed(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Each prompt's embedding (float32; unit length where the bundle normalizes), in the
        order given; prompts longer than the largest prefill bucket run in chunks."""
        if not self.embeds:
            raise RequestError(
                f"{self.loaded.bundle.root}: this bundle generates text (task: generate) and "
                "computes no embeddings",
                hint="build a bundle with task: embed (docs/manifest.md#embed-bundles)",
            )
        return [s.embedding for s in self.generate(prompts, EMBED)]

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        adapters: str | None | list[str | None] = None,
        priority: list[int] | None = None,
    ) -> list[SequenceState]:
        """Run prompts to completion together; results in the order given. Every prompt is
        checked before any runs, so a request that cannot fit fails the whole call at once.
        `adapters`: the adapter every prompt runs with, or one per prompt (None: the base);
        `priority`: one per prompt (vLLM's; the priority scheduling policy)."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        names = adapters if isinstance(adapters, list) else [adapters] * len(prompts)
        ranks = priority if priority is not None else [0] * len(prompts)
        triples = list(zip(prompts, per_prompt, names, strict=True))
        config = self.core.scheduler.config
        for (prompt, p, name), rank in zip(triples, ranks, strict=True):
            check_priority(config.policy, rank)
            check_fits(config, prompt, p)
            if p.structured is not None and self.core.grammars is not None:
                self.core.grammars.check(p.structured)
            if name is not None:
                self.core.adapter_key(name)  # served here
        seqs = [
            self.core.add_request(prompt, p, name, rank)
            for (prompt, p, name), rank in zip(triples, ranks, strict=True)
        ]
        timings = self.core.runner.timings
        while self.core.has_work():
            calls = timings.prefill_chunks + timings.decode_steps
            self.core.step()
            if timings.prefill_chunks + timings.decode_steps == calls:  # never, if blocks add up
                raise RuntimeError("the scheduler ran no graph in a step with work waiting")
        return seqs


@dataclass(frozen=True)
class GenerateRequest:
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    # user messages, each a one-turn conversation rendered through the bundle's chat template
    chats: list[str] = field(default_factory=list)
    params: SamplingParams = OFFLINE
    prefix_caching: bool = True  # False: the bundle's prefix caching off for this run
    speculation: bool = True  # False: plain decoding in a bundle with verify graphs
    threads: int | None = None  # engine threads (None: platform/cpus.py's default)
    lora: tuple[str, str] | None = None  # (name, PEFT directory): every prompt runs with it
    scheduling: SchedulingOptions = SchedulingOptions()  # the policy, a smaller KV pool


def run_offline(
    bundle_path: Path,
    request: GenerateRequest,
    dist_timeout_s: float = DEFAULT_TIMEOUT_S,
    executor: str = "auto",
) -> dict[str, Any] | None:
    """Prompts run together (continuous batching); outputs come back in the order given.

    A bundle built for several ranks runs one process per rank (rank 0 returns the report, other
    ranks of a torchrun launch return None).
    """
    if not request.texts and not request.token_ids and not request.chats:
        raise RequestError(
            "nothing to generate: give --prompt TEXT, --chat TEXT or --prompt-ids 1,2,3"
        )
    import torch

    torch.set_num_threads(engine_threads(request.threads))  # ranks > 1 split the CPUs instead
    return run_on_ranks(
        bundle_path, lambda loaded: _report(loaded, request), executor, dist_timeout_s
    )


def _report(loaded: LoadedBundle, request: GenerateRequest) -> dict[str, Any]:
    import torch

    tok = loaded.tokenizer
    if (request.texts or request.chats) and tok is None:
        raise RequestError("this bundle has no tokenizer: use --prompt-ids")
    prompts = [tok.encode(t) for t in request.texts] if tok and request.texts else []
    prompts += request.token_ids
    if tok is not None:
        prompts += [tok.encode_chat([{"role": "user", "content": c}]) for c in request.chats]
    lora = dict([request.lora]) if request.lora else {}
    llm = LLM(
        loaded,
        request.prefix_caching,
        request.speculation,
        lora_modules=lora,
        scheduling=request.scheduling,
        threads=request.threads,
    )
    t0 = time.perf_counter()
    outputs = _outputs(llm, prompts, request)
    wall = time.perf_counter() - t0
    t = loaded.runner.timings
    governor = llm.core.governor
    return {
        "outputs": outputs,
        "timings": {
            "load_s": round(loaded.load_seconds, 4),
            "warm_up_s": round(loaded.warm_up_seconds, 4),  # of load_s: each graph's first call
            "prefill_s": round(t.prefill_s, 4),
            "prefill_calls": t.prefill_chunks,  # packed: one call prefills several prompts
            "decode_s": round(t.decode_s, 4),
            "decode_tokens": t.decode_tokens,
            "decode_ms_per_token": round(1000 * t.decode_s / max(t.decode_steps, 1), 4),
            # metadata a decode step rewrote (what a device executor uploads), bytes per step
            "decode_meta_bytes_per_step": round(t.decode_meta_bytes / max(t.decode_steps, 1), 1),
            "wall_s": round(wall, 4),
            "cached_prompt_tokens": sum(o.get("cached_tokens", 0) for o in outputs),
            "verify_steps": t.verify_steps,
            # the engine's intra-op threads at the end (the governor's choice, not a trial's)
            "threads": governor.held if governor else torch.get_num_threads(),
            "thread_reductions": governor.reductions if governor else 0,  # the governor's
        },
        "speculation": _speculation_report(llm),
    }


def _outputs(llm: LLM, prompts: list[list[int]], request: GenerateRequest) -> list[dict[str, Any]]:
    """Each prompt's output: its generated text and tokens, or an embed bundle's embedding."""
    if llm.embeds:
        return [
            {"embedding": vector.tolist(), "prompt_tokens": len(prompt)}
            for vector, prompt in zip(llm.embed(prompts), prompts, strict=True)
        ]
    tok = llm.loaded.tokenizer
    seqs = llm.generate(prompts, request.params, request.lora[0] if request.lora else None)
    return [
        {
            "token_ids": s.output_ids,
            "text": tok.decode(s.output_ids) if tok else None,
            "finish_reason": s.finish_reason,
            "cached_tokens": s.num_cached,
        }
        for s in seqs
    ]


def _speculation_report(llm: LLM) -> dict[str, Any] | None:
    """vLLM's spec-decode counts and the mean acceptance length (None: no speculation)."""
    if llm.core.scheduler.config.speculation is None:
        return None
    spec = llm.core.scheduler.spec
    draft = llm.core.draft
    model = (
        {
            "draft_calls": draft.calls,
            "draft_prefill_s": round(draft.prefill_s, 4),
            "draft_propose_s": round(draft.propose_s, 4),
        }
        if draft is not None
        else {}
    )
    return {
        "drafts": spec.drafts,
        "draft_tokens": spec.draft_tokens,
        "accepted_tokens": spec.accepted_tokens,
        "accepted_per_position": spec.accepted_per_position,
        "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
        **model,
    }
