"""The engine core's own process when serving.

An AOTInductor graph call holds the GIL for its whole run, so an engine thread inside the HTTP
server would serialise every graph call with all request handling; as in vLLM's V1 engine core,
the core runs in its own process and talks to the server over one pipe: the server sends
`("add", id, prompt_ids, params, adapter, priority)` and `("abort", id, reason)`, the core
answers once per step with every request's new tokens and the scheduler's state; and each
`("load", call_id, name, path)` / `("unload", call_id, name)` with an ADAPTER message (a load's
adapter is read between two steps). Detokenisation stays in the server (core_client.py). With
tp > 1 this process is rank 0 and starts the other ranks, as offline.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from neffkit.errors import RequestError
from neffkit.runtime.config import SchedulingOptions
from neffkit.runtime.engine.core import EngineCore, engine_threads
from neffkit.runtime.engine.governor import ThreadGovernor, default_governor
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.step_output import TokenLogprobs

if TYPE_CHECKING:  # loading a bundle imports torch: the core process does it when it starts
    from neffkit.runtime.worker.loader import LoadedBundle

# messages core → server
READY, STEP, FAILED, ADAPTER = "ready", "step", "failed", "adapter"


class CoreOutput(NamedTuple):
    """One request's news in a STEP message (a tuple on the pipe: cheap to pickle)."""

    rid: int
    new_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # the first output only
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    embedding: Any = None  # an embed bundle's request, finished: np.ndarray [width] float32


def new_output(rid: int, seq: SequenceState, sent: int) -> CoreOutput:
    """What the server has not seen of a sequence; its prompt logprobs go with the first."""
    logprobs = seq.output_logprobs[sent:] if seq.params.logprobs is not None else None
    prompt = seq.prompt_logprobs if sent == 0 and seq.params.prompt_logprobs is not None else None
    return CoreOutput(
        rid,
        seq.output_ids[sent:],
        seq.finish_reason,
        logprobs,
        prompt,
        seq.num_cached,
        seq.embedding,
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
                _, rid, prompt_ids, params, adapter, priority = msg
                try:
                    self.live[rid] = self.core.add_request(prompt_ids, params, adapter, priority)
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
    counts = (s.cache_queries, s.cache_hits, s.preemptions)
    return (len(s.running), s.num_waiting, s.kv_usage, *counts, spec, lora)


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
    scheduling: SchedulingOptions | None = None,
    cpus: tuple[int, ...] | None = None,
) -> None:
    """Entry point of the core process (spawned by the server); `lora_modules` (name → PEFT
    directory) are registered before it says READY, so a bad one stops the server's start.
    `cpus`: the CPUs it (and its ranks) may use, a data-parallel replica's share."""
    try:
        if cpus:  # before torch sizes its pools: the threads follow the share (cpus.py)
            os.sched_setaffinity(0, cpus)
        import torch

        full = engine_threads(threads)
        torch.set_num_threads(full)
        from neffkit.runtime.engine.adapters import adapter_manager
        from neffkit.runtime.engine.loading import attach_proposer, grammars_of
        from neffkit.runtime.worker.distributed import run_on_ranks

        def governor(loaded: LoadedBundle) -> ThreadGovernor | None:
            return default_governor(threads, full, loaded.bundle.record.layout.world_size)

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
                    scheduling=scheduling,
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
    scheduling: SchedulingOptions | None = None,
    cpus: tuple[int, ...] | None = None,
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
            scheduling,
            cpus,
        ),
        name="neffkit-engine-core",
        daemon=True,
    )
    proc.start()
    theirs.close()
    return proc, ours
