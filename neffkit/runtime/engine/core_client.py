"""The server's side of the engine core: requests in, streamed text out, over the core's pipe.

The engine core runs in its own process (engine/core.py). This side validates requests against
the bundle's buckets before they are sent (a 400, not a failed sequence), bounds the queue (503),
detokenises incrementally, applies stop strings, and records the latency metrics (TTFT,
inter-token latency, end-to-end) next to the tokens they measure. A reader thread receives one
message per engine step and hands each request's events to its callback, and the core's answer
to each adapter load or unload to the future its caller waits on. The adapters served (by name)
are tracked here, changed in the same order as the requests sent, so a request names an adapter
the core has.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from neffkit.errors import AdapterError, BundleError, NeffkitError, RequestError
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.core_process import ADAPTER, FAILED, READY, STEP, CoreOutput
from neffkit.runtime.engine.detokenizer import IncrementalDetokenizer
from neffkit.runtime.engine.limits import check_fits, check_priority
from neffkit.runtime.engine.metrics import Metrics
from neffkit.runtime.sampling_params import SamplingParams, shown
from neffkit.runtime.tokenizer import Tokenizer
from neffkit.runtime.worker.step_output import TokenLogprobs

log = logging.getLogger(__name__)


class ServerBusy(RequestError):
    """The waiting queue is full (503)."""

    default_hint = "retry later, or serve with a larger --max-waiting (docs/serving.md#scheduling)"


class NotFound(RequestError):
    """A request names a model (or adapter) this server does not serve (404)."""


def unknown_model(name: str) -> NotFound:
    """vLLM's 404 for a request's `model` that is neither the served model nor an adapter."""
    return NotFound(f"The model `{shown(name, name)}` does not exist.", param="model")


class EngineDead(NeffkitError):
    """The engine core (or one of its ranks) died: requests fail with a 5xx naming the cause, and
    the server shuts down with a non-zero status so a supervisor restarts it."""

    default_hint = "its cause is logged above; docs/serving.md#a-dead-engine-is-never-a-zombie"


@dataclass
class Event:
    """New text/tokens for one request; `finish_reason` set on its last event."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # echo: prompt tokens after the first
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    embedding: Any = None  # an embed bundle's request, on its last event: np.ndarray float32


@dataclass
class Stream:
    """One request as the server tracks it."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    detok: IncrementalDetokenizer | None  # None: a bundle without a tokenizer (ids only)
    arrived: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False
    engine: int = 0  # the data-parallel replica serving it (replicas/group.py)


class EngineClient:
    """Talks to the engine core; `submit` and `abort` are safe from any thread."""

    def __init__(
        self,
        core: BaseProcess,
        conn: Connection,
        config: SchedulerConfig,
        tokenizer: Tokenizer | None,
        metrics: Metrics,
        max_waiting: int = 256,
        on_failure: Callable[[str], None] | None = None,
        lora_modules: Mapping[str, str] | None = None,
    ) -> None:
        """`lora_modules`: the adapters the core registers as it starts (name → directory)."""
        self.core, self.conn = core, conn
        self.on_failure = on_failure  # called once, from the reader thread, when the core dies
        self.config = config  # the bundle's buckets and block counts: requests checked here
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._ids = itertools.count()
        self._live: dict[int, Stream] = {}
        self._lock = threading.Lock()  # guards _live and the pipe's send side
        self._error: str | None = None
        self._stopping = False
        # adapters served (name → directory) and being loaded; the calls awaiting the core's
        # answer: id → (future, name, directory: a load's)
        self.adapters: dict[str, str] = dict(lora_modules or {})
        self._loading: set[str] = set()
        self._calls: dict[int, tuple[Future[None], str, str | None]] = {}
        self._call_ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="neffkit-engine-io", daemon=True)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def start(self) -> None:
        """Wait until the core has loaded the bundle (or say why it could not)."""
        try:
            kind, detail = self.conn.recv()
        except EOFError:
            kind, detail = FAILED, f"the engine process exited (code {self.core.exitcode})"
        if kind != READY:
            raise BundleError(f"the engine could not start: {detail}")
        self._reader.start()

    def stop(self) -> None:
        self._stopping = True  # the core's pipe closing now is the answer, not a failure
        with self._lock:
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        self.core.join(timeout=30)
        if self.core.is_alive():
            self.core.terminate()

    @property
    def healthy(self) -> bool:
        return self._error is None and self.core.is_alive()

    @property
    def status(self) -> str:
        """What /health says while healthy."""
        return "ok"

    def outstanding_tokens(self) -> int:
        """Tokens the live requests hold or will: each one's prompt and max_tokens (chat's
        unset one counts none), a data-parallel router's measure of an engine's load."""
        with self._lock:
            streams = list(self._live.values())
        return sum(len(s.prompt_ids) + (s.params.max_tokens or 0) for s in streams)

    @property
    def failure(self) -> str | None:
        """Why the engine stopped, once it has."""
        return self._error

    # ------------------------------------------------------------ any thread

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: tuple[str, ...],
        emit: Callable[[Event], None],
        include_stop: bool = False,
        adapter: str | None = None,
        priority: int = 0,
    ) -> Stream:
        """Validate (RequestError → 400), bound the queue (→ 503), send to the core (with the
        name of the adapter the request runs with, if any, and its priority)."""
        if self._error is not None:
            raise EngineDead(f"the engine failed: {self._error}")
        check_priority(self.config.policy, priority)
        check_fits(self.config, prompt_ids, params)
        with self._lock:
            if adapter is not None and adapter not in self.adapters:  # unloaded meanwhile
                raise unknown_model(adapter)
            queued = sum(1 for s in self._live.values() if s.first_token_at is None)
            if queued >= self.max_waiting:
                raise ServerBusy(
                    f"server busy: {queued} requests already waiting for KV-cache blocks "
                    f"(limit {self.max_waiting}, --max-waiting)"
                )
            detok = (
                IncrementalDetokenizer(self.tokenizer, stop, include_stop, params.min_tokens)
                if self.tokenizer
                else None
            )
            stream = Stream(
                rid=next(self._ids),
                prompt_ids=list(prompt_ids),
                params=params,
                emit=emit,
                detok=detok,
            )
            self._live[stream.rid] = stream
            self.conn.send(("add", stream.rid, stream.prompt_ids, params, adapter, priority))
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        if adapter is not None:
            self.metrics.lora_request(adapter)
        return stream

    def load_adapter(self, name: str, path: str) -> Future[None]:
        """Ask the core to serve the adapter at `path` as `name`: done when the future is (its
        exception: AdapterError, it cannot be served; EngineDead). RequestError: the name is
        taken."""
        with self._lock:
            if name in self.adapters or name in self._loading:
                raise RequestError(
                    f"adapter {name!r} is already loaded", hint="unload it first", param="lora_name"
                )
            self._loading.add(name)
            return self._call(("load", name, path), name, path)

    def unload_adapter(self, name: str) -> Future[None]:
        """Stop serving `name`: requests naming it from now on get a 404, those already sent
        finish (NotFound: no adapter of that name is loaded)."""
        with self._lock:
            if name not in self.adapters:
                raise NotFound(f"adapter {name!r} is not loaded", param="lora_name")
            del self.adapters[name]
            return self._call(("unload", name), name, None)

    def _call(self, msg: tuple[str, ...], name: str, path: str | None) -> Future[None]:
        """Send a load or unload with a new call id (the lock held)."""
        if self._error is not None:
            raise EngineDead(f"the engine failed: {self._error}")
        future: Future[None] = Future()
        cid = next(self._call_ids)
        self._calls[cid] = (future, name, path)
        try:
            self.conn.send((msg[0], cid, *msg[1:]))
        except OSError:  # the core is gone: the reader thread reports why
            del self._calls[cid]
            self._loading.discard(name)
            raise EngineDead("the engine is not running") from None
        return future

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        """The client went away (or a stop string matched): the core frees its KV blocks."""
        with self._lock:
            if stream.done:
                return
            stream.done = True
            self._live.pop(stream.rid, None)
            try:
                self.conn.send(("abort", stream.rid, reason))
            except OSError:  # the core is gone: nothing holds the request's blocks any more
                pass
        self.metrics.finished(reason, time.perf_counter() - stream.arrived)

    # ------------------------------------------------------------ reader thread

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                if self._stopping:
                    return
                self.core.join(timeout=5)
                kind, payload = FAILED, f"the engine process exited (code {self.core.exitcode})"
            if kind == FAILED:
                self._fail(str(payload))
                return
            if kind == ADAPTER:
                self._answer(*payload)
            if kind == STEP:
                outputs, stats = payload
                for out in outputs:
                    with self._lock:
                        stream = self._live.get(out.rid)
                    if stream is not None:
                        self._deliver(stream, out)
                if stats is not None:
                    self.metrics.observe_stats(*stats)

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, new_ids: list[int]) -> tuple[str, list[int]]:
        """The text to show and the tokens to report: with stop strings, several tokens of one
        step (speculative decoding) go in one at a time, and none after a stop is reported."""
        if len(new_ids) < 2 or not detok.stop:
            return detok.step(new_ids), new_ids
        delta, kept = "", []
        for token in new_ids:
            delta += detok.step([token])
            kept.append(token)
            if detok.stopped:
                break
        return delta, kept

    def _answer(self, cid: int, refused: str | None, missing: bool) -> None:
        """The core's answer to a load or unload: a loaded adapter is served from now on."""
        with self._lock:
            call = self._calls.pop(cid, None)
            if call is None:
                return
            future, name, path = call
            if path is not None:
                self._loading.discard(name)
                if refused is None:
                    self.adapters[name] = path
        if refused is None:
            future.set_result(None)
        else:
            future.set_exception(
                NotFound(refused, param="lora_name") if missing else AdapterError(refused)
            )

    def _fail(self, detail: str) -> None:
        """The core is gone: every live request (and adapter call) ends with the cause; then
        the server stops."""
        self._error = detail
        log.error("neffkit: the engine failed: %s", detail)
        with self._lock:
            streams, self._live = list(self._live.values()), {}
            calls, self._calls = list(self._calls.values()), {}
            for stream in streams:  # ended: an abort later sends nothing (a replica's next
                stream.done = True  # client numbers its requests afresh)
        for stream in streams:
            stream.emit(Event(detail, [], finish_reason="error"))
        for future, _, _ in calls:
            future.set_exception(EngineDead(f"the engine failed: {detail}"))
        if self.on_failure is not None:
            self.on_failure(detail)

    def _deliver(self, stream: Stream, out: CoreOutput) -> None:
        new_ids, finish = out.new_ids, out.finish_reason
        delta, stopped = "", False
        if stream.detok is not None:
            delta, new_ids = self._detokenize(stream.detok, new_ids)
            stopped = stream.detok.stopped
            if stopped:
                finish = "stop"
            elif finish is not None:
                delta += stream.detok.finish()
        logprobs = out.logprobs[: len(new_ids)] if out.logprobs is not None else None
        now = time.perf_counter()
        if new_ids:
            if stream.first_token_at is None:
                stream.first_token_at = now
                self.metrics.ttft.observe(now - stream.arrived)
            elif stream.last_token_at is not None:
                self.metrics.itl.observe(now - stream.last_token_at)
            stream.last_token_at = now
            self.metrics.generation_tokens.inc(len(new_ids))
            stream.output_ids += new_ids
        event = Event(
            text=delta,
            token_ids=new_ids,
            finish_reason=finish,
            prompt_tokens=len(stream.prompt_ids),
            completion_tokens=len(stream.output_ids),
            logprobs=logprobs,
            prompt_logprobs=out.prompt_logprobs,
            cached_tokens=out.cached_tokens,
            embedding=out.embedding,
        )
        if finish is not None:
            if stopped:
                self.abort(stream, "stop")  # the core has not finished it: free its blocks
            else:
                with self._lock:
                    stream.done = True
                    self._live.pop(stream.rid, None)
                self.metrics.finished(finish, now - stream.arrived)
        stream.emit(event)
