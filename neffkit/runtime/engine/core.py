"""The engine core: scheduler + runner, one `step` at a time; and its own process when serving.

`EngineCore.step` is the whole loop body (nano-vllm's `LLMEngine.step`): admit, run one prefill
chunk, run one decode step, hand the scheduler the tokens. Offline generation (llm.py) drives it
directly. When serving, an AOTInductor graph call holds the GIL for its whole run, so an engine
thread inside the HTTP server would serialise every graph call with all request handling; as in
vLLM's V1 engine core, the core runs in its own process and talks to the server over one pipe:
the server sends `("add", id, prompt_ids, params, adapter)` and `("abort", id, reason)`, the core
answers once per step with every request's new tokens and the scheduler's state; and each
`("load", call_id, name, path)` / `("unload", call_id, name)` with an ADAPTER message (a load's
adapter is read between two steps). Detokenisation stays in the server
(core_client.py). With tp > 1 this process is rank 0 and starts the other ranks, as offline.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from neffkit.errors import RequestError
from neffkit.platform.cpus import chosen_threads, resolve_threads
from neffkit.runtime.engine.governor import ThreadGovernor
from neffkit.runtime.engine.limits import check_fits, output_budget
from neffkit.runtime.engine.scheduler import Scheduler
from neffkit.runtime.engine.structured import Grammars
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.spec_decode.proposer import Proposer, per_row
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.logit_inputs import Penalties
from neffkit.runtime.worker.runner import ModelRunner
from neffkit.runtime.worker.step_output import TokenLogprobs

if TYPE_CHECKING:  # loading a bundle imports torch: the core process does it when it starts
    from neffkit.runtime.engine.adapters import AdapterManager
    from neffkit.runtime.worker.loader import LoadedBundle

# messages core → server
READY, STEP, FAILED, ADAPTER = "ready", "step", "failed", "adapter"
# request ids, unique in the process: the runner's decode buffers tell rows apart by them, and
# several engines may drive one loaded bundle in turn
REQUEST_IDS = itertools.count()
COMPILE_POLL_S = 0.01  # an engine with nothing but grammars compiling looks for news this often


class CoreOutput(NamedTuple):
    """One request's news in a STEP message (a tuple on the pipe: cheap to pickle)."""

    rid: int
    new_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # the first output only
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


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
    ) -> None:
        """False turns off the bundle's prefix caching / speculative decoding for this engine;
        `proposer` replaces the bundle's speculation method's (tests drive the verify graphs
        with chosen drafts); `grammars` compiles structured-output constraints (the bundle's
        tokenizer's); `adapters` serves the bundle's adapter slots (`lora:`)."""
        self.runner = runner
        self.adapters = adapters
        self.grammars = runner.grammars = grammars
        self.governor = governor  # threads under contention (governor.py); None: fixed
        config = runner.config
        if not prefix_caching:
            config = replace(config, prefix_caching=False)
        if not speculation:
            config = replace(config, speculation=None)
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
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> SequenceState:
        """Queue a request (RequestError if no bucket can serve it, or `adapter` is not served
        here); unseeded ones get a seed. A grammar not compiled yet compiles on a grammar
        thread: the request is queued when it is done (`step`), so no step waits on a
        compile."""
        layout = self.scheduler.config
        if params.max_tokens is None:  # up to the context limit (check_fits refuses <= 0)
            params = replace(params, max_tokens=output_budget(layout, len(prompt_ids), params))
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        seq = SequenceState(
            request_id=next(REQUEST_IDS),
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed & 0xFFFFFFFF,
        )
        if adapter is not None:
            seq.adapter, seq.adapter_key = adapter, self.adapter_key(adapter)
        if params.structured is not None:
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


# ---------------------------------------------------------------- the core's own process


def new_output(rid: int, seq: SequenceState, sent: int) -> CoreOutput:
    """What the server has not seen of a sequence; its prompt logprobs go with the first."""
    logprobs = seq.output_logprobs[sent:] if seq.params.logprobs is not None else None
    prompt = seq.prompt_logprobs if sent == 0 and seq.params.prompt_logprobs is not None else None
    return CoreOutput(
        rid, seq.output_ids[sent:], seq.finish_reason, logprobs, prompt, seq.num_cached
    )


class _Stopped(Exception):
    """The server said stop, or is gone without a word: nobody to serve."""


class _Serving:
    """The core process's side of the pipe: the live requests, what each has been sent, and
    the server's adapter loads and unloads (answered by their call ids)."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        from neffkit.runtime.engine.adapters import AdapterCalls  # torch: this process only

        self.core, self.conn = core, conn
        self.live: dict[int, SequenceState] = {}
        self.sent: dict[int, int] = {}
        self.calls = AdapterCalls(core.adapters)

    def receive(self) -> bool:
        """Handle every message waiting (True: any came); _Stopped when told to stop."""
        changed = False
        while self.conn.poll():
            try:
                msg = self.conn.recv()
            except EOFError:
                raise _Stopped() from None
            changed = True
            if msg[0] == "stop":
                raise _Stopped()
            if msg[0] == "add":
                _, rid, prompt_ids, params, adapter = msg
                try:
                    self.live[rid] = self.core.add_request(prompt_ids, params, adapter)
                    self.sent[rid] = 0
                except RequestError:  # the server validates first; this is a safety net
                    self.conn.send((STEP, ([CoreOutput(rid, [], "error")], None)))
            elif msg[0] == "abort":
                _, rid, reason = msg
                if rid in self.live:
                    self.core.abort(self.live.pop(rid), reason)
                    self.sent.pop(rid)
            elif msg[0] in ("load", "unload"):
                self.conn.send((ADAPTER, self.calls.handle(msg)))
        return changed

    def step(self) -> list[CoreOutput]:
        """One engine step; every live request's news."""
        outputs: list[CoreOutput] = []
        if not self.core.has_work():
            return outputs
        self.core.step()
        for rid, seq in list(self.live.items()):
            if len(seq.output_ids) == self.sent[rid] and not seq.finished:
                continue
            outputs.append(new_output(rid, seq, self.sent[rid]))
            self.sent[rid] = len(seq.output_ids)
            if seq.finished:
                del self.live[rid], self.sent[rid]
        return outputs


def step_stats(core: EngineCore) -> tuple:
    """The scheduler's state after a step, for the server's metrics (metrics.observe_stats):
    with adapter slots, the adapters of the admitted and of the waiting requests too."""
    s, sp = core.scheduler, core.scheduler.spec
    spec = (sp.drafts, sp.draft_tokens, sp.accepted_tokens, tuple(sp.accepted_per_position))
    lora = core.adapters.stats([*s.prefilling, *s.running], s.waiting) if core.adapters else None
    return (len(s.running), s.num_waiting, s.kv_usage, s.cache_queries, s.cache_hits, spec, lora)


def serve_engine(core: EngineCore, conn: Connection) -> None:
    """The core process's loop: messages in, one STEP message out per engine step, an ADAPTER
    message per load or unload asked."""
    serving = _Serving(core, conn)
    conn.send((READY, core.max_model_len))
    while True:
        if not core.has_work():  # idle: sleep until the server sends something
            conn.poll(None)
        try:
            changed = serving.receive()
        except _Stopped:
            return
        outputs = serving.step()
        if outputs or changed:
            conn.send((STEP, (outputs, step_stats(core))))


def engine_threads(requested: int | None = None) -> int:
    """Intra-op threads of the engine core: `--threads`, else `NEFFKIT_ENGINE_THREADS`, else
    every CPU this process may use (platform/cpus.py: affinity and cgroup quota).

    Leaving one core to the HTTP process paid when decode steps were microseconds (demo model);
    with batched decode compute-bound, two threads serve more on a 2-core host at 1 stream and
    at 8 (bench/serve.py on the 125M model: 62 vs 52 and 230 vs 137 tok/s). On the demo model
    throughput is level within noise and the 1-stream ITL p99 rises from ~1 to ~5 ms."""
    return resolve_threads(requested)


def core_main(
    conn: Connection,
    bundle: str,
    executor: str,
    dist_timeout_s: float,
    prefix_caching: bool,
    speculation: bool,
    threads: int | None = None,
    lora_modules: dict[str, str] | None = None,
    max_cpu_loras: int | None = None,
) -> None:
    """Entry point of the core process (spawned by the server); `lora_modules` (name → PEFT
    directory) are registered before it says READY, so a bad one stops the server's start."""
    try:
        import torch

        full = engine_threads(threads)
        torch.set_num_threads(full)
        from neffkit.runtime.engine.adapters import adapter_manager
        from neffkit.runtime.engine.loading import attach_proposer, grammars_of
        from neffkit.runtime.worker.distributed import run_on_ranks

        # a governor where nobody chose the count, one rank
        def governor(loaded: LoadedBundle) -> ThreadGovernor | None:
            chosen = chosen_threads(threads) is not None
            ranks = loaded.bundle.record.layout.world_size
            return None if chosen or ranks > 1 else ThreadGovernor(full, torch.set_num_threads)

        run_on_ranks(
            bundle,
            lambda loaded: serve_engine(
                EngineCore(
                    attach_proposer(loaded).runner,
                    prefix_caching,
                    speculation,
                    grammars=grammars_of(loaded),
                    governor=governor(loaded),
                    adapters=adapter_manager(loaded, lora_modules or {}, max_cpu_loras),
                ),
                conn,
            ),
            executor=executor,
            timeout_s=dist_timeout_s,
        )
    except BaseException as exc:  # noqa: BLE001 - the server reports it and stops
        from neffkit.errors import NeffkitError

        if isinstance(exc, NeffkitError):
            detail = exc.message
        else:  # the whole story goes to the log; the cause goes to the server and its clients
            traceback.print_exc()
            detail = f"{type(exc).__name__}: {exc}"
        try:
            conn.send((FAILED, detail))
        except OSError:
            pass


def start_core(
    bundle: Path,
    executor: str,
    dist_timeout_s: float,
    prefix_caching: bool = True,
    speculation: bool = True,
    threads: int | None = None,
    lora_modules: dict[str, str] | None = None,
    max_cpu_loras: int | None = None,
) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(
        target=core_main,
        args=(
            theirs,
            str(bundle),
            executor,
            dist_timeout_s,
            prefix_caching,
            speculation,
            threads,
            lora_modules,
            max_cpu_loras,
        ),
        name="neffkit-engine-core",
        daemon=True,
    )
    proc.start()
    theirs.close()
    return proc, ours
