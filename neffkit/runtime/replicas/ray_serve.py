"""Data-parallel replicas on a Ray cluster, as a Ray Serve application (`neffkit run BUNDLE
--ray-address ADDR --data-parallel N`, the `ray` extra with Ray Serve).

Two deployments. `EngineReplica` (N replicas, Ray places them on the cluster's nodes): one
engine core and its client each, its bundle read from a path every node sees or streamed from a
pack URL (contract/pack.py). `Front` (one replica, on Ray Serve's HTTP proxy): the same OpenAI
server as `neffkit run` (app.py), whose engine sends each request to an engine replica through
a deployment handle and streams its events back (`RayEngine`); Ray Serve routes those calls by
prefix (ray_router.py). /metrics joins what every replica last posted to a named actor (each
replica's series labelled with its replica id) with the front's.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from neffkit.contract.read import read_bundle
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.core_client import EngineClient, Event, Stream
from neffkit.runtime.engine.metrics import Metrics
from neffkit.runtime.engine.structured import GrammarLimits
from neffkit.runtime.replicas.exposition import render_joined
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.serve.api_server import EngineOptions
from neffkit.runtime.tokenizer import Tokenizer

BOARD = "neffkit-metrics"  # the named actor replicas post their metrics to
POST_INTERVAL_S = 1.0
STALE_S = 5 * POST_INTERVAL_S


def local_path(bundle: str) -> Path:
    """A bundle on this node: a path, or a pack URL streamed into the bundle cache (checked)."""
    if "://" not in bundle:
        return Path(bundle)
    from neffkit.contract.pack import unpack_bundle

    return unpack_bundle(bundle)


class MetricsBoard:
    """Each engine replica's latest /metrics text, by replica id; a replica that stopped posting
    (dead, replaced) drops out after STALE_S."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def all(self) -> list[str]:
        now = time.monotonic()
        self.texts = {r: (t, text) for r, (t, text) in self.texts.items() if now - t < STALE_S}
        return [text for _, text in self.texts.values()]


@dataclass(frozen=True)
class ReplicaOptions:
    """What an engine replica starts with (picklable: Ray ships it to the node)."""

    bundle: str
    model_name: str
    max_waiting: int = 256
    engine: EngineOptions = EngineOptions()  # noqa: RUF009 (frozen)


class EngineReplica:
    """One engine core and its client, on the node Ray placed it."""

    def __init__(self, options: ReplicaOptions, board: Any) -> None:
        path = local_path(options.bundle)
        record = read_bundle(path, verify=False).record
        tokenizer = Tokenizer.from_dir(path / record.tokenizer) if record.tokenizer else None
        self.replica = serve.get_replica_context().replica_id.unique_id
        metrics = Metrics(options.model_name, engine=self.replica)
        core, conn = options.engine.start_core(path, {})
        config = options.engine.scheduler_config(record)
        self.client = EngineClient(
            core, conn, config, tokenizer, metrics, options.max_waiting, self._died
        )
        self.client.start()
        self.board = board
        threading.Thread(target=self._post, daemon=True, name="neffkit-metrics-post").start()

    def _died(self, detail: str) -> None:
        """The core is gone (its client's reader thread): this replica ends with it, so Ray
        routes around it at once and starts another (a failed health check would take
        seconds); its requests in flight have ended with the cause."""
        print(f"neffkit: the engine failed ({detail}); ending this replica", flush=True)
        os._exit(1)

    def check_health(self) -> None:  # Ray Serve's health check
        if not self.client.healthy:
            raise RuntimeError(f"the engine failed: {self.client.failure}")

    def _post(self) -> None:
        while True:
            self.board.post.remote(self.replica, self.client.metrics.render().decode())
            time.sleep(POST_INTERVAL_S)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: tuple[str, ...],
        include_stop: bool = False,
        adapter: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Event]:
        """One request's events, the last with its finish reason; the caller's cancel aborts it."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event: Event) -> None:  # the client's reader thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        stream = self.client.submit(prompt_ids, params, stop, emit, include_stop, adapter, priority)
        try:
            while True:
                event = await queue.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.client.abort(stream)  # a no-op once it finished

    def ready(self) -> bool:
        return self.client.healthy

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.stop()


class RayEngine:
    """The server's engine (serve/engine_api.py) over the engine replicas' deployment handle:
    each request streamed from the replica Ray Serve routes it to."""

    def __init__(self, handle: Any, config: SchedulerConfig, max_waiting: int) -> None:
        self.handle, self.config, self.max_waiting = handle, config, max_waiting
        self.adapters: dict[str, str] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._ids = iter(range(1 << 62))

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    healthy = True
    status = "ok"

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
        """Called on the server's event loop: the request streams from its replica in a task."""
        from neffkit.runtime.engine.limits import check_fits

        check_fits(self.config, prompt_ids, params)
        stream = Stream(
            rid=next(self._ids), prompt_ids=list(prompt_ids), params=params, emit=emit, detok=None
        )
        call = self.handle.options(stream=True).generate
        events = call.remote(prompt_ids, params, stop, include_stop, adapter=adapter)

        async def pump() -> None:
            try:
                async for event in events:
                    emit(event)
            except Exception as exc:  # noqa: BLE001 - the request ends with the cause
                emit(Event(f"the engine replica failed: {exc}", [], finish_reason="error"))
            finally:
                self._tasks.pop(stream.rid, None)

        self._tasks[stream.rid] = asyncio.get_running_loop().create_task(pump())
        return stream

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        task = self._tasks.pop(stream.rid, None)
        if task is not None:
            task.cancel()  # cancels the replica's generator: it aborts the sequence

    def load_adapter(self, name: str, path: str) -> Future[None]:
        raise NotImplementedError("adapters are not served over Ray yet")

    def unload_adapter(self, name: str) -> Future[None]:
        raise NotImplementedError("adapters are not served over Ray yet")


class BoardMetrics:
    """/metrics: every replica's last post, family by family, refreshed by a thread each second
    (App's route renders without waiting on the cluster)."""

    def __init__(self, board: Any) -> None:
        self.board = board
        self.text = b""
        threading.Thread(target=self._refresh, daemon=True, name="neffkit-metrics").start()

    def _refresh(self) -> None:
        while True:
            try:
                texts = self.board.all.remote().result()
            except Exception:  # noqa: BLE001 - the board restarting: the last render stands
                time.sleep(POST_INTERVAL_S)
                continue
            families = (f for text in texts for f in text_string_to_metric_families(text))
            self.text = render_joined(families)
            time.sleep(POST_INTERVAL_S)

    def render(self) -> bytes:
        return self.text


@dataclass(frozen=True)
class FrontOptions:
    """The server's settings the front takes (picklable)."""

    bundle: str
    model_name: str
    max_waiting: int = 256
    api_key: str | None = None
    tool_parser: str | None = "auto"
    reasoning_parser: str | None = None
    chat_template: str | None = None
    strict_requests: bool = False
    compact_json: bool = False
    grammar_timeout_s: float = 5.0
    public_metrics: bool = False


class Front:
    """The OpenAI server (app.py) over the engine replicas (Ray Serve's ingress)."""

    def __init__(self, engines: Any, board: Any, options: FrontOptions) -> None:
        from neffkit.runtime.serve.api_server import ChatOptions, chat_setup
        from neffkit.runtime.serve.app import App

        bundle = read_bundle(local_path(options.bundle), verify=False)
        o = options
        chat = ChatOptions(o.tool_parser, o.reasoning_parser, o.chat_template)
        tokenizer, parsers = chat_setup(bundle, chat)
        engine = RayEngine(engines, SchedulerConfig.of(bundle.record), o.max_waiting)
        # the handle learns the replicas from its first call on: make it before any request's,
        # or a first burst finds one replica known (off the event loop: it blocks)
        threading.Thread(target=lambda: engines.ready.remote().result(), daemon=True).start()
        self.state = App(
            bundle=bundle,
            tokenizer=tokenizer,
            engine_loop=engine,
            metrics=BoardMetrics(board),
            model_name=o.model_name,
            api_key=o.api_key,
            strict_requests=o.strict_requests,
            tool_parser=parsers[0],
            reasoning_parser=parsers[1],
            compact_json=o.compact_json,
            grammar_limits=GrammarLimits(timeout_s=o.grammar_timeout_s),
            public_metrics=o.public_metrics,
        )

    def __serve_build_asgi_app__(self) -> Any:
        from neffkit.runtime.serve.app import create_app

        return create_app(self.state)


def ray_application(replicas: int, engine: ReplicaOptions, front: FrontOptions) -> Any:
    """The Serve application: `replicas` engine replicas (a CPU each, routed by prefix), the
    metrics board and the front."""
    from ray.serve.config import RequestRouterConfig

    from neffkit.runtime.replicas.ray_router import PrefixAffinityRouter

    block_size = read_bundle(local_path(engine.bundle), verify=False).record.layout.block_size
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,  # type: ignore[arg-type]
        request_router_kwargs={"block_size": block_size},
    )
    deployment: Any = serve.deployment  # typed as a decorator; called on classes here
    board = deployment(MetricsBoard).options(ray_actor_options={"num_cpus": 0}).bind()
    engines = deployment(EngineReplica).options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 1},
        request_router_config=router,
        health_check_period_s=2,
        max_ongoing_requests=max(1, engine.max_waiting),
    )
    ingress = deployment(serve.ingress()(Front)).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max(1, 4 * front.max_waiting)
    )
    return ingress.bind(engines.bind(engine, board), board, front)


def _wait_for_replicas(replicas: int, timeout_s: float = 600.0) -> None:
    """Until every engine replica runs (each loads the bundle and warms its graphs up)."""
    from neffkit.errors import BundleError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get("neffkit")
        states = app.deployments["EngineReplica"].replica_states.items() if app else ()
        if sum(n for state, n in states if getattr(state, "value", state) == "RUNNING") >= replicas:
            return
        time.sleep(0.5)
    raise BundleError(f"the engine replicas did not start within {timeout_s:.0f} s")


def serve_on_ray(
    address: str, host: str, port: int, replicas: int, engine: ReplicaOptions, front: FrontOptions
) -> int:
    """Run the application on the cluster at `address` until SIGINT/SIGTERM; then delete it."""
    import signal

    import ray

    ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(ray_application(replicas, engine, front), name="neffkit", route_prefix="/")
    _wait_for_replicas(replicas)
    print(f"neffkit: serving {front.model_name!r} at http://{host}:{port}/v1 on Ray", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    serve.delete("neffkit")
    return 0
