"""What the server's routes use of the engine: one engine client (engine/core_client.py), or a
data-parallel group of them (replicas/group.py)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.core_client import Event, Stream
from neffkit.runtime.sampling_params import SamplingParams


class ServingEngine(Protocol):
    """The engine as the routes see it."""

    config: SchedulerConfig
    max_waiting: int
    adapters: dict[str, str]

    @property
    def max_model_len(self) -> int: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def status(self) -> str: ...

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: tuple[str, ...],
        emit: Callable[[Event], None],
        include_stop: bool = False,
        adapter: str | None = None,
        priority: int = 0,
    ) -> Stream: ...

    def abort(self, stream: Stream, reason: str = "abort") -> None: ...

    def load_adapter(self, name: str, path: str) -> Future[None]: ...

    def unload_adapter(self, name: str) -> Future[None]: ...
