"""The engine core: scheduler + runner, one `step` at a time.

`EngineCore.step` is the whole loop body (nano-vllm's `LLMEngine.step`): admit, run one prefill
chunk, run one decode step, hand the scheduler the tokens. Offline generation (llm.py) drives it
directly; when serving, it runs in a process of its own (core_process.py).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from neffkit.errors import RequestError
from neffkit.platform.cpus import resolve_threads
from neffkit.runtime.config import SchedulingOptions
from neffkit.runtime.engine.governor import ThreadGovernor
from neffkit.runtime.engine.limits import check_fits, check_priority, output_budget
from neffkit.runtime.engine.scheduler import Scheduler
from neffkit.runtime.engine.structured import Grammars
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.spec_decode.proposer import Proposer, per_row
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.logit_inputs import Penalties
from neffkit.runtime.worker.runner import ModelRunner

if TYPE_CHECKING:  # loading a bundle imports torch: the core process does it when it starts
    from neffkit.runtime.engine.adapters import AdapterManager

# request ids, unique in the process: the runner's decode buffers tell rows apart by them, and
# several engines may drive one loaded bundle in turn
REQUEST_IDS = itertools.count()
COMPILE_POLL_S = 0.01  # an engine with nothing but grammars compiling looks for news this often


class EngineCore:
    """Continuous batching over fixed-shape graphs. Not thread-safe: one caller drives `step`."""

    def __init__(
        self,
        runner: ModelRunner,
        prefix_caching: bool = True,
        speculation: bool = True,
        proposer: Proposer | None = None,
        grammars: Grammars | None = None,
        governor: ThreadGovernor | None = None,
        adapters: AdapterManager | None = None,
        scheduling: SchedulingOptions | None = None,
    ) -> None:
        """False turns off the bundle's prefix caching / speculative decoding for this engine;
        `proposer` replaces the bundle's speculation method's (tests drive the verify graphs
        with chosen drafts); `grammars` compiles structured-output constraints (the bundle's
        tokenizer's); `adapters` serves the bundle's adapter slots (`lora:`); `scheduling`:
        the policy and a smaller KV pool."""
        self.runner = runner
        self.adapters = adapters
        self.grammars = runner.grammars = grammars
        self.governor = governor  # threads under contention (governor.py); None: fixed
        config = runner.config
        if not prefix_caching:
            config = replace(config, prefix_caching=False)
        if not speculation:
            config = replace(config, speculation=None)
        config = (scheduling or SchedulingOptions()).apply(config)
        self.scheduler = Scheduler(config, adapters)
        # a draft model's graphs (the loader attaches them to the runner) run with speculation
        self.draft = runner.draft if config.speculation is not None else None
        if self.draft is not None:
            self.scheduler.proposer = self.draft.propose
        if proposer is not None and config.speculation is not None:
            self.scheduler.proposer = per_row(proposer)
        self._seed_rng = np.random.default_rng()
        # requests whose grammar is compiling on a grammar thread, queued once it is done
        self._compiling: list[tuple[SequenceState, Future[Any]]] = []

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
        priority: int = 0,
    ) -> SequenceState:
        """Queue a request (RequestError if no bucket can serve it, `adapter` is not served
        here, or `priority` is set under fcfs); unseeded ones get a seed. A grammar not
        compiled yet compiles on a grammar thread: the request is queued when it is done
        (`step`), so no step waits on a compile."""
        layout = self.scheduler.config
        check_priority(layout.policy, priority)
        if params.max_tokens is None:  # up to the context limit (check_fits refuses <= 0)
            params = replace(params, max_tokens=output_budget(layout, len(prompt_ids), params))
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        seq = SequenceState(
            request_id=next(REQUEST_IDS),
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed & 0xFFFFFFFF,
            priority=priority,
        )
        if adapter is not None:
            seq.adapter, seq.adapter_key = adapter, self.adapter_key(adapter)
        if params.structured is not None:
            after = params.structured.after_token  # none if the prompt ended the reasoning
            seq.grammar_after = after if after is not None and after not in prompt_ids else None
            if self.grammars is None:
                raise RequestError(
                    "structured outputs need the bundle's tokenizer", param=params.structured.field
                )
            check_fits(layout, seq.prompt_ids, params)  # what the bundle can serve, first
            compiled = self.grammars.prepare(params.structured)
            if not compiled.done():
                self._compiling.append((seq, compiled))
                return seq
            seq.grammar = compiled.result().deep_copy()  # a refused one queues nothing
        self._queue(seq)
        return seq

    def adapter_key(self, name: str) -> str:
        """The key a request for adapter `name` is queued under (RequestError: not served)."""
        if self.adapters is None:
            raise RequestError(f"this bundle serves no adapters ({name!r})", param="model")
        return self.adapters.key(name)

    def _queue(self, seq: SequenceState) -> None:
        self.scheduler.add(seq)  # checks what the bundle can serve
        if seq.params.penalized:  # as wide as the bundle's pairs, which add checked it fits
            seq.penalties = Penalties(
                self.scheduler.config.penalty_tokens, seq.params, seq.prompt_ids
            )

    def _compiled(self) -> list[SequenceState]:
        """Queue the requests whose grammar is compiled; a refused one ends with "error" (the
        server checked it first, so only a safety net) and is returned, so its client hears of
        it. With nothing else to do, wait a little for one."""
        if not self._compiling:
            return []
        if not self.scheduler.has_work():
            wait([f for _, f in self._compiling], COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        still, ended = [], []
        for seq, compiled in self._compiling:
            if seq.finished:  # aborted while it compiled
                continue
            if not compiled.done():
                still.append((seq, compiled))
            elif compiled.exception() is not None:
                seq.finish_reason = "error"
                ended.append(seq)
            else:
                seq.grammar = compiled.result().deep_copy()
                self._queue(seq)
        self._compiling = still
        return ended

    def abort(self, seq: SequenceState, reason: str = "abort") -> None:
        self.scheduler.abort(seq, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling)

    def step(self) -> list[SequenceState]:
        """Queue the requests whose grammar compiled, admit what fits, run one prefill call
        (packed chunks) and one decode step; return the touched sequences."""
        sched, touched = self.scheduler, self._compiled()
        sched.admit()
        prefill = sched.next_prefill()
        if prefill is not None:
            out = self.runner.prefill(prefill)
            if self.draft is not None:  # the draft's cache gets the same prompt positions
                self.draft.prefill(prefill, out)
            touched += sched.prefilled(prefill, out)
        batch = sched.next_decode()
        if batch is not None:
            t0 = time.perf_counter()
            out = self.runner.decode(batch)
            if self.governor is not None:
                self.governor.observe(out.graph, time.perf_counter() - t0)
            if self.draft is not None:  # an MTP layer keeps the target's hidden states
                self.draft.observe(batch, out)
            touched += sched.decoded(batch, out)
        return touched


def engine_threads(requested: int | None = None) -> int:
    """Intra-op threads of the engine core: `--threads`, else `NEFFKIT_ENGINE_THREADS`, else
    every CPU this process may use (platform/cpus.py: affinity and cgroup quota).

    Leaving one core to the HTTP process paid when decode steps were microseconds (demo model);
    with batched decode compute-bound, two threads serve more on a 2-core host at 1 stream and
    at 8 (bench/serve.py on the 125M model: 62 vs 52 and 230 vs 137 tok/s). On the demo model
    throughput is level within noise and the 1-stream ITL p99 rises from ~1 to ~5 ms."""
    return resolve_threads(requested)
