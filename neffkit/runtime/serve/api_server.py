"""The server process (`neffkit run --serve`): reads the bundle, starts the engine core in its own
process and the engine client beside it, and runs the FastAPI application (app.py) under uvicorn
until SIGINT/SIGTERM or the engine's death, then stops the core. `--lora-modules` adapters are
registered by the core before it is ready, so a bad one stops the start.

Binds 127.0.0.1 unless told otherwise; `--api-key` requires `Authorization: Bearer KEY` on every
route but /health. uvicorn runs with the limits of `HttpLimits`
(docs/serving.md#http-limits-and-the-api-key): an idle connection's keep-alive, the size of a
request head, the time a request head may take to arrive (uvicorn has no such timeout:
`_head_deadline_protocol` adds it), the graceful shutdown's bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.contract.read import Bundle, read_bundle
from neffkit.errors import AdapterError, NeffkitError
from neffkit.runtime.config import SchedulerConfig, SchedulingOptions
from neffkit.runtime.engine.core_client import EngineClient
from neffkit.runtime.engine.core_process import start_core
from neffkit.runtime.engine.metrics import Metrics
from neffkit.runtime.engine.structured import GrammarLimits
from neffkit.runtime.replicas.group import EngineGroup, Failed, Replica, replica_cpus
from neffkit.runtime.serve.access import HttpLimits, enable_access_log
from neffkit.runtime.serve.app import App, create_app
from neffkit.runtime.serve.lora import LoraModule, runtime_updating
from neffkit.runtime.serve.tool_prompt import choose_parser, template_takes_tools
from neffkit.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    import uvicorn
    from fastapi import FastAPI

    from neffkit.contract.records import BundleRecord


def _graceful_server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT once it has shut down, which kills the process
        before `serve` stops the engine core (the core then sees its pipe break): here the
        signal ends `run` and `serve` finishes its own shutdown, with exit status 0."""

        announce = ""  # said once listening (a port taken since the probe: never said)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and self.announce:
                print(self.announce, flush=True)

    return GracefulServer


def _head_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline on each request head: from the connection's
    opening, or the end of the previous response on it, the client has `timeout_s` to send the
    request line and headers whole, else the connection is closed. uvicorn alone waits forever
    for a head sent a byte at a time (slowloris: its keep-alive timer restarts on every byte)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch_head()

        def handle_events(self) -> None:  # every byte received and every response's end
            super().handle_events()
            self._watch_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

        def _watch_head(self) -> None:
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if waiting and self.head_timer is None:
                self.head_timer = self.loop.call_later(timeout_s, self._head_late)
            elif not waiting and self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_late(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline


class _HttpServer:
    """uvicorn on the main thread, until a signal, or until the engine client's reader thread
    reports the engine dead (`shut_down`)."""

    def __init__(self, host: str, port: int, limits: HttpLimits) -> None:
        """Tries the port at once: a port in use is refused before the engine loads; the server
        says it is serving only once uvicorn listens."""
        self.host, self.port, self.limits = host, port, limits
        self.server: uvicorn.Server | None = None  # once running, for shut_down
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:  # a probe: uvicorn binds its own socket (handing it one changed how it serves)
            socket.create_server((host, port), family=family).close()
        except OSError as exc:
            raise NeffkitError(
                f"--host {host} --port {port}: cannot listen there "
                f"({os.strerror(exc.errno) if exc.errno else exc})",
                hint="pick another --port, or stop what holds it",
            ) from None

    def shut_down(self, detail: str) -> None:  # the reader thread: uvicorn polls should_exit
        print(f"neffkit: the engine failed ({detail}); shutting down", file=sys.stderr, flush=True)
        if self.server is not None:
            self.server.should_exit = True

    def run(self, api: FastAPI, name: str) -> None:
        import uvicorn

        limits = self.limits
        config = uvicorn.Config(
            api,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            http=_head_deadline_protocol(limits.header_timeout_s),
            timeout_keep_alive=limits.keep_alive_s,
            h11_max_incomplete_event_size=limits.max_header_bytes,
            timeout_graceful_shutdown=limits.graceful_shutdown_s,
        )
        server = _graceful_server_class()(config)
        server.announce = f"neffkit: serving {name!r} at http://{self.host}:{self.port}/v1"
        self.server = server
        server.run()


@dataclass(frozen=True)
class ChatOptions:
    """How the server reads and writes chats: --tool-call-parser, --reasoning-parser and
    --chat-template (None: the bundle's)."""

    tool_parser: str | None = "auto"
    reasoning_parser: str | None = None
    chat_template: str | None = None


@dataclass(frozen=True)
class EngineOptions:
    """How the server runs its engine cores (`neffkit run`'s flags): the executor, the ranks'
    timeout, prefix caching, speculation, threads, adapters in memory, the scheduling policy,
    and `data_parallel` replicas (> 1: each on its share of the CPUs, restarted when it dies:
    replicas/)."""

    executor: str = "auto"
    dist_timeout_s: float = 60.0
    prefix_caching: bool = True
    speculation: bool = True
    threads: int | None = None
    max_cpu_loras: int | None = None
    scheduling: SchedulingOptions | None = None
    data_parallel: int = 1

    def scheduler_config(self, record: BundleRecord) -> SchedulerConfig:
        """The bundle's buckets and blocks under this scheduling (a bad policy or pool size:
        refused before any engine starts)."""
        return (self.scheduling or SchedulingOptions()).apply(SchedulerConfig.of(record))

    def start_core(
        self, bundle: Path, adapters: dict[str, str], cpus: tuple[int, ...] | None = None
    ) -> tuple[BaseProcess, Connection]:
        """An engine core process on `bundle` (on `cpus`, else every CPU) and its pipe."""
        engine = (self.executor, self.dist_timeout_s, self.prefix_caching, self.speculation)
        return start_core(
            bundle, *engine, self.threads, adapters, self.max_cpu_loras, self.scheduling, cpus
        )


@dataclass(frozen=True)
class _Cores:
    """Starts one engine core and its client: the server's only one, or a replica's."""

    bundle: Path
    options: EngineOptions
    config: SchedulerConfig
    tokenizer: Tokenizer | None
    model_name: str
    max_waiting: int

    def start(
        self, replica: Replica | None, adapters: dict[str, str], failed: Failed
    ) -> EngineClient:
        """A replica's client started (its core ready: the group's threads wait), or the
        server's only one, to start."""
        cpus, metrics = (
            (replica.cpus, replica.metrics) if replica else (None, Metrics(self.model_name))
        )
        core, conn = self.options.start_core(self.bundle, adapters, cpus)
        client = EngineClient(
            core, conn, self.config, self.tokenizer, metrics, self.max_waiting, failed, adapters
        )
        if replica is not None:
            _started(client)
        return client


def serve(
    bundle_path: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    max_waiting: int = 256,
    strict_requests: bool = False,
    access_log: bool = True,
    chat: ChatOptions = ChatOptions(),  # noqa: B008 (frozen)
    compact_json: bool = False,
    grammar_timeout_s: float = GrammarLimits.timeout_s,
    http_limits: HttpLimits | None = None,
    public_metrics: bool = False,
    lora_modules: list[LoraModule] | None = None,
    engine: EngineOptions = EngineOptions(),  # noqa: B008 (frozen)
) -> int:
    """Serve until SIGINT/SIGTERM (exit 0), or the engine's death (1, once requests got 5xx;
    data-parallel replicas restart instead)."""
    bundle = read_bundle(bundle_path, verify=False)  # the core verifies hashes as it loads
    record, name = bundle.record, model_name or bundle.record.name
    tokenizer, parsers = chat_setup(bundle, chat)
    paths, parents = _adapters(lora_modules or [], name)
    lay = engine.scheduler_config(record)  # checked first
    shares = replica_cpus(engine.data_parallel) if engine.data_parallel > 1 else []
    http = _HttpServer(host, port, http_limits or HttpLimits())  # the port first: fail fast
    cores = _Cores(bundle_path, engine, lay, tokenizer, name, max_waiting)
    group = EngineGroup(cores.start, shares, lay, name, max_waiting, paths) if shares else None
    client = group or cores.start(None, paths, http.shut_down)
    try:
        client.start()
        app = App(
            bundle=bundle,
            tokenizer=tokenizer,
            engine_loop=client,
            metrics=group.metrics if group else client.metrics,
            model_name=name,
            api_key=api_key,
            strict_requests=strict_requests,
            access_log=access_log,
            tool_parser=parsers[0],
            reasoning_parser=parsers[1],
            compact_json=compact_json,
            grammar_limits=GrammarLimits(timeout_s=grammar_timeout_s),
            max_request_bytes=http.limits.max_request_bytes,
            public_metrics=public_metrics,
            lora_parents=parents,
            runtime_lora=runtime_updating(),
        )
        if access_log:
            enable_access_log()
        http.run(create_app(app), name)
    finally:
        client.stop()
    return 1 if client.failure is not None else 0


def _started(client: EngineClient) -> None:
    """Wait for a client's core to load the bundle; one that cannot is stopped (its process
    reaped) before the error goes on."""
    try:
        client.start()
    except BaseException:
        client.stop()
        raise


def chat_setup(
    bundle: Bundle, chat: ChatOptions
) -> tuple[Tokenizer | None, tuple[str | None, str | None]]:
    """The bundle's tokenizer, its chat template replaced by --chat-template, and the (tool
    call, reasoning) parsers, the tool parser's `auto` resolved."""
    record = bundle.record
    tokenizer = Tokenizer.from_dir(bundle.path(record.tokenizer)) if record.tokenizer else None
    if chat.chat_template is not None:
        if tokenizer is None:
            raise NeffkitError(f"{bundle.root}: --chat-template needs the bundle's tokenizer")
        tokenizer.chat_template = chat.chat_template
    tool_parser = _tool_parser(chat.tool_parser, tokenizer, record.model.architecture)
    return tokenizer, (tool_parser, chat.reasoning_parser)


def _tool_parser(chosen: str | None, tokenizer: Tokenizer | None, architecture: str) -> str | None:
    """`--tool-call-parser`, `auto` resolved from the chat template (tool_prompt.py); a
    template without tools is said once, as the prompts will carry them instead."""
    template = tokenizer.chat_template if tokenizer else None
    if chosen == "auto":
        chosen = choose_parser(template, architecture)
    if tokenizer is not None and not template_takes_tools(template):
        print(
            "neffkit: warning: the chat template has no tools section: a request's tools go "
            "into its system message in hermes's format "
            "(docs/serving.md#structured-outputs-and-tool-calls)",
            file=sys.stderr,
            flush=True,
        )
    return chosen


def _adapters(modules: list[LoraModule], served: str) -> tuple[dict[str, str], dict[str, str]]:
    """`--lora-modules`' directories and named bases, by name (AdapterError: a name given twice,
    or the served model's)."""
    paths: dict[str, str] = {}
    for module in modules:
        if module.name in paths or module.name == served:
            taken = "given twice" if module.name in paths else "the served model's name"
            raise AdapterError(f"--lora-modules: {module.name!r} is {taken}")
        paths[module.name] = module.path
    return paths, {m.name: m.base_model_name for m in modules if m.base_model_name}
