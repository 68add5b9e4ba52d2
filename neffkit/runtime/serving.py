"""The engine behind the HTTP server: one thread drives `Engine.step`, requests stream tokens back.

The engine is not thread-safe, so exactly one thread (the engine loop) touches it. HTTP handlers
hand it work through a locked inbox (submit, abort) and get events back through a callback that
the server turns into an asyncio queue per request. Detokenisation, stop strings and the latency
metrics (TTFT, inter-token latency, end-to-end) live here, next to the tokens they measure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neffkit.errors import RequestError
from neffkit.runtime.engine import Engine, SamplingParams, SequenceState
from neffkit.runtime.metrics import Metrics
from neffkit.runtime.tokenizer import Tokenizer


class ServerBusy(RequestError):
    """The waiting queue is full (503)."""


@dataclass
class Event:
    """New text/tokens for one request; `finish_reason` set on its last event."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Stream:
    """One request as the engine loop tracks it."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    emit: Callable[[Event], None]
    arrived: float = field(default_factory=time.perf_counter)
    seq: SequenceState | None = None
    sent_tokens: int = 0
    sent_text: str = ""
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False


class EngineLoop:
    """Owns the engine; `submit` and `abort` are safe from any thread."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer | None,
        metrics: Metrics,
        max_waiting: int = 256,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._inbox: list[Stream] = []
        self._aborts: list[Stream] = []
        self._live: dict[int, Stream] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="neffkit-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------ any thread

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: tuple[str, ...],
        emit: Callable[[Event], None],
    ) -> Stream:
        """Validate against the bundle's buckets (RequestError → 400) and queue the request."""
        if self._error is not None:
            raise RuntimeError(f"the engine stopped: {self._error}")
        self.engine.validate(prompt_ids, params)  # reads only the layout: safe here
        stream = Stream(prompt_ids, params, stop, emit)
        with self._wake:
            waiting = len(self._inbox) + len(self.engine.waiting)
            if waiting >= self.max_waiting:
                raise ServerBusy(
                    f"server busy: {waiting} requests already waiting for KV-cache blocks "
                    f"(limit {self.max_waiting}, --max-waiting)"
                )
            self._inbox.append(stream)
            self._wake.notify()
        return stream

    def abort(self, stream: Stream) -> None:
        """The client went away: free its sequence and KV blocks (idempotent)."""
        with self._wake:
            self._aborts.append(stream)
            self._wake.notify()

    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (
                        self._stopping or self._inbox or self._aborts or self.engine.has_work()
                    ):
                        self._wake.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for stream in inbox:
                    stream.seq = self.engine.add_request(stream.prompt_ids, stream.params)
                    self._live[stream.seq.request_id] = stream
                    self.metrics.prompt_tokens.inc(len(stream.prompt_ids))
                for stream in aborts:
                    self._finish(stream, "abort", notify=False)
                if self.engine.has_work():
                    for seq in self.engine.step():
                        stream = self._live.get(seq.request_id)
                        if stream is not None:
                            self._deliver(stream)
                self.metrics.observe_engine(self.engine)
        except BaseException as exc:  # a graph failed: fail every open request, say why
            self._error = exc
            for stream in list(self._live.values()):
                stream.emit(Event("", [], finish_reason="error"))
            raise

    def _deliver(self, stream: Stream) -> None:
        seq = stream.seq
        assert seq is not None
        now = time.perf_counter()
        new_ids = seq.output_ids[stream.sent_tokens :]
        if not new_ids:
            return
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.metrics.ttft.observe(now - stream.arrived)
        elif stream.last_token_at is not None:
            self.metrics.itl.observe(now - stream.last_token_at)
        stream.last_token_at = now
        self.metrics.generation_tokens.inc(len(new_ids))
        stream.sent_tokens = len(seq.output_ids)
        text = self.tokenizer.decode(seq.output_ids) if self.tokenizer else ""
        finish = seq.finish_reason
        cut = _first_stop(text, stream.stop, len(stream.sent_text))
        if cut is not None:
            text, finish = text[:cut], "stop"
        elif finish is None and text.endswith("\ufffd"):
            text = stream.sent_text  # a multi-byte character is incomplete: wait for its rest
        delta = ""
        if text.startswith(stream.sent_text):  # decoding a longer prefix never rewrites the past
            delta, stream.sent_text = text[len(stream.sent_text) :], text
        stream.emit(Event(delta, new_ids, finish, len(stream.prompt_ids), stream.sent_tokens))
        if finish is not None:
            self._finish(stream, finish, notify=False)

    def _finish(self, stream: Stream, reason: str, notify: bool) -> None:
        if stream.done:
            return
        stream.done = True
        if stream.seq is not None:
            self.engine.abort(stream.seq, reason)
            self._live.pop(stream.seq.request_id, None)
        self.metrics.finished(reason, time.perf_counter() - stream.arrived)
        if notify:
            stream.emit(Event("", [], reason))


def _first_stop(text: str, stops: tuple[str, ...], searched_upto: int) -> int | None:
    """Index where the earliest stop string starts (searching only text not yet sent)."""
    start = max(0, searched_upto - max((len(s) for s in stops), default=0))
    hits = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise RequestError("stop must be a string or a list of strings")
