"""N engine clients as one (core_client.ServingEngine): each request to the replica routing.py
picks, adapter loads and unloads to every replica, and a replica that dies restarted.

A replica's death is its client's: the reader thread sees the core's pipe close and ends the
requests in flight on it; those that had not produced a token go to another replica, the others'
clients get a 5xx, as a single engine's would. The group then
routes around it, /health says "degraded", and a thread starts a new core in its place after a
backoff (1 s, doubling up to 30 s while starts fail), registering the adapters served now. The
server stops only when asked: a replica that keeps failing keeps being retried.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from neffkit.errors import NeffkitError, RequestError
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.core_client import (
    EngineClient,
    Event,
    NotFound,
    ServerBusy,
    Stream,
    unknown_model,
)
from neffkit.runtime.engine.metrics import Metrics
from neffkit.runtime.replicas.exposition import FrontMetrics, JoinedMetrics
from neffkit.runtime.replicas.routing import PrefixRouter
from neffkit.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0


def replica_cpus(replicas: int) -> list[tuple[int, ...]]:
    """This process's CPUs dealt into `replicas` contiguous shares (the first ones one larger
    where they do not divide); each replica's engine and ranks run on its share."""
    cpus = sorted(os.sched_getaffinity(0))
    if replicas > len(cpus):
        raise NeffkitError(
            f"--data-parallel {replicas}: this process may use {len(cpus)} CPUs, and each "
            "replica needs one at least",
            hint=f"use --data-parallel {len(cpus)} or fewer",
        )
    size, extra = divmod(len(cpus), replicas)
    shares, at = [], 0
    for i in range(replicas):
        n = size + (i < extra)
        shares.append(tuple(cpus[at : at + n]))
        at += n
    return shares


MAX_RETRIES = 2  # times a request that lost its replica before its first token is sent again


@dataclass
class _Request:
    """A request as the group relays it: its submit arguments, the caller's callback, and the
    stream on the replica serving it now."""

    args: tuple[list[int], SamplingParams, tuple[str, ...], bool, str | None, int]
    emit: Callable[[Event], None]
    stream: Stream | None = None
    produced: bool = False  # a token reached the caller: it can no longer move
    retries: int = 0
    key: int = 0  # the caller's stream (the first one's id), by which it aborts
    done: bool = False


@dataclass
class Replica:
    """One engine core and its client; `client` is replaced when it restarts."""

    index: int
    cpus: tuple[int, ...]
    metrics: Metrics
    client: EngineClient | None = None
    restarting: bool = False

    @property
    def serving(self) -> bool:
        return self.client is not None and self.client.healthy and not self.restarting


Failed = Callable[[str], None]  # told why, once, from a client's reader thread when it dies
# (replica, the adapters to register: name → directory, the client's failure callback) → a
# started client (its core READY); BundleError where the core could not start
Starter = Callable[[Replica, dict[str, str], Failed], EngineClient]


class EngineGroup:
    """The server's engine over `len(cpus)` replicas of one bundle."""

    def __init__(
        self,
        start: Starter,
        shares: list[tuple[int, ...]],
        config: SchedulerConfig,
        model_name: str,
        max_waiting: int,
        adapters: dict[str, str],
    ) -> None:
        self.config, self.max_waiting, self.adapters = config, max_waiting, dict(adapters)
        self._start = start
        self.replicas = [
            Replica(i, cpus, Metrics(model_name, engine=str(i))) for i, cpus in enumerate(shares)
        ]
        self.front = FrontMetrics(model_name, len(shares))
        self.metrics = JoinedMetrics(
            lambda: [self.front.registry, *(r.metrics.registry for r in self.replicas)]
        )
        self.router = PrefixRouter(len(shares), config.block_size)
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}  # by the caller's stream's id
        self._stopping = False
        self.failure: str | None = None  # replicas restart: the group itself never fails

    # ------------------------------------------------------------ lifetime
    def start(self) -> None:
        """Start every replica at once (each loads the bundle); the first that cannot start
        fails the whole start, the others stopped."""
        errors: list[BaseException] = []

        def start_one(replica: Replica) -> None:
            try:
                replica.client = self._start(replica, self.adapters, self._on_failure(replica))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on the main thread
                errors.append(exc)

        threads = [threading.Thread(target=start_one, args=(r,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]

    def stop(self) -> None:
        self._stopping = True
        for replica in self.replicas:
            if replica.client is not None:
                replica.client.stop()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def healthy(self) -> bool:
        return any(r.serving for r in self.replicas)

    @property
    def status(self) -> str:
        up = sum(r.serving for r in self.replicas)
        if up == len(self.replicas):
            return "ok"
        return f"degraded: {up} of {len(self.replicas)} engines serving (the others restarting)"

    # ------------------------------------------------------------ requests
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
        """To the replica the router picks among those serving (503 where none is)."""
        if adapter is not None and adapter not in self.adapters:
            raise unknown_model(adapter)
        request = _Request((prompt_ids, params, stop, include_stop, adapter, priority), emit)
        first = self._send(request)
        with self._lock:  # it may have ended already (the relay holds the lock to say so)
            request.key = id(first)
            if not request.done:
                self._requests[request.key] = request
        return first

    def _send(self, request: _Request) -> Stream:
        prompt_ids, params, stop, include_stop, adapter, priority = request.args
        with self._lock:
            loads = [
                r.client.outstanding_tokens() if r.serving and r.client else None
                for r in self.replicas
            ]
            if all(load is None for load in loads):
                raise ServerBusy("no engine is serving: every replica is restarting")
            replica = self.replicas[self.router.choose(prompt_ids, loads, adapter)]
        assert replica.client is not None
        index = replica.index

        def relay(event: Event) -> None:
            self._relay(request, event, index)

        stream = replica.client.submit(
            prompt_ids,
            params,
            stop,
            relay,
            include_stop,
            adapter,
            priority,
        )
        stream.engine = replica.index
        request.stream = stream
        self.front.engine(self.front.routed, replica.index).inc()
        return stream

    def _relay(self, request: _Request, event: Event, replica: int) -> None:
        """A replica's event for `request` (its client's reader thread): passed on, but where
        `replica` died before the request produced a token (its client has seen nothing of
        it), the request goes to another replica instead, up to MAX_RETRIES times."""
        client = self.replicas[replica].client
        died = client is not None and client.failure is not None
        if event.finish_reason == "error" and died and not request.produced and not self._stopping:
            if request.retries < MAX_RETRIES:
                request.retries += 1
                try:
                    self._send(request)
                    return
                except NeffkitError:  # none serving: the request ends with the cause
                    pass
        request.produced = request.produced or bool(event.token_ids)
        if event.finish_reason is not None:
            with self._lock:
                request.done = True
                self._requests.pop(request.key, None)
        request.emit(event)

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        """The request `stream` began as, wherever it runs now."""
        with self._lock:
            request = self._requests.pop(id(stream), None)
        current = request.stream if request is not None and request.stream else stream
        client = self.replicas[current.engine].client
        if client is not None and not current.done:
            client.abort(current, reason)

    # ------------------------------------------------------------ adapters
    def load_adapter(self, name: str, path: str) -> Future[None]:
        """Load on every replica serving; done when all are (the first refusal its error)."""
        with self._lock:
            if name in self.adapters:
                raise RequestError(
                    f"adapter {name!r} is already loaded", hint="unload it first", param="lora_name"
                )
            calls = [client.load_adapter(name, path) for client in self._serving()]
        return self._all(calls, lambda: self.adapters.__setitem__(name, path))

    def unload_adapter(self, name: str) -> Future[None]:
        with self._lock:
            if name not in self.adapters:
                raise NotFound(f"adapter {name!r} is not loaded", param="lora_name")
            del self.adapters[name]
            calls = [client.unload_adapter(name) for client in self._serving()]
        return self._all(calls, lambda: None)

    def _serving(self) -> list[EngineClient]:
        return [r.client for r in self.replicas if r.serving and r.client is not None]

    @staticmethod
    def _all(calls: list[Future[None]], done: Callable[[], None]) -> Future[None]:
        joined: Future[None] = Future()
        left = [len(calls)]

        def one(call: Future[None]) -> None:
            if joined.done():
                return
            error = call.exception()
            if error is not None:
                joined.set_exception(error)
                return
            left[0] -= 1
            if left[0] == 0:
                done()
                joined.set_result(None)

        for call in calls:
            call.add_done_callback(one)
        if not calls:
            done()
            joined.set_result(None)
        return joined

    # ------------------------------------------------------------ restarts
    def _on_failure(self, replica: Replica) -> Failed:
        def failed(detail: str) -> None:  # the dead client's reader thread
            if self._stopping:
                return
            log.error("neffkit: engine %d failed (%s); restarting it", replica.index, detail)
            with self._lock:
                replica.restarting = True
                self.router.forget(replica.index)  # its prefix cache died with it
            self.front.up.set(sum(r.serving for r in self.replicas))
            threading.Thread(
                target=self._restart, args=(replica,), name=f"neffkit-restart-{replica.index}"
            ).start()

        return failed

    def _restart(self, replica: Replica) -> None:
        backoff = FIRST_BACKOFF_S
        while not self._stopping:
            time.sleep(backoff)
            if self._stopping:
                return
            try:
                client = self._start(replica, dict(self.adapters), self._on_failure(replica))
            except NeffkitError as exc:
                log.error("neffkit: engine %d did not start (%s)", replica.index, exc.message)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
                continue
            if self._stopping:  # stopped while it started: nobody will stop it later
                client.stop()
                return
            with self._lock:
                replica.metrics.restarted()
                replica.client, replica.restarting = client, False
            self.front.engine(self.front.restarts, replica.index).inc()
            self.front.up.set(sum(r.serving for r in self.replicas))
            log.warning("neffkit: engine %d is serving again", replica.index)
            return
