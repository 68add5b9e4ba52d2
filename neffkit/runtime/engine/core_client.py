"""The server's side of the engine core: requests in, streamed text out, over the core's pipe.

The engine core runs in its own process (engine/core.py). This side validates requests against
the bundle's buckets before they are sent (a 400, not a failed sequence), bounds the queue (503),
detokenises incrementally, applies stop strings, and records the latency metrics (TTFT,
inter-token latency, end-to-end) next to the tokens they measure. A reader thread receives one
message per engine step and hands each request's events to its callback.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from neffkit.errors import BundleError, NeffkitError, RequestError
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.core import FAILED, READY, STEP, CoreOutput
from neffkit.runtime.engine.detokenizer import IncrementalDetokenizer
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.engine.metrics import Metrics
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.tokenizer import Tokenizer
from neffkit.runtime.worker.step_output import TokenLogprobs

log = logging.getLogger(__name__)


class ServerBusy(RequestError):
    """The waiting queue is full (503)."""

    default_hint = "retry later, or serve with a larger --max-waiting (docs/serving.md#scheduling)"


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
    ) -> None:
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
    ) -> Stream:
        """Validate (RequestError → 400), bound the queue (→ 503), send to the core (with the
        name of the adapter the request runs with, if any)."""
        if self._error is not None:
            raise EngineDead(f"the engine failed: {self._error}")
        check_fits(self.config, prompt_ids, params)
        with self._lock:
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
            self.conn.send(("add", stream.rid, stream.prompt_ids, params, adapter))
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return stream

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

    def _fail(self, detail: str) -> None:
        """The core is gone: every live request ends with the cause; then the server stops."""
        self._error = detail
        log.error("neffkit: the engine failed: %s", detail)
        with self._lock:
            streams, self._live = list(self._live.values()), {}
        for stream in streams:
            stream.emit(Event(detail, [], finish_reason="error"))
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
