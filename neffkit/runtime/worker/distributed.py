"""Multi-rank serving: one process per rank under torch.distributed (gloo on cpu, nccl on cuda).

Rank 0 owns the scheduler and the tokenizer. Before every graph call it broadcasts one int64
tensor (command, graph index, the step's packed metadata); every rank then runs
the same graph on its own weights and KV cache, and the graph's collectives meet. Followers loop
until rank 0 broadcasts STOP. `neffkit run` starts the follower processes itself, or joins a
`torchrun` launch (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), so multi-host runs use
torch.distributed's own rendezvous. A rank that dies surfaces as an error on the others within the
process-group timeout, never a hang.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from neffkit.contract.read import read_bundle
from neffkit.errors import AdapterError, NeffkitError, RequestError
from neffkit.platform.cpus import usable_cpus
from neffkit.runtime.lora.peft_adapter import Adapter, read_adapter
from neffkit.runtime.worker.adapters import AdapterSlots
from neffkit.runtime.worker.loader import LoadedBundle, load
from neffkit.runtime.worker.runner import GraphEntry, ModelRunner

log = logging.getLogger(__name__)
STOP, RUN, ADAPTER = 0, 1, 2
# an ADAPTER message: [slot, name, directory] as JSON, 8 bytes a word (4 KiB at most)
ADAPTER_WORDS = 512
DEFAULT_TIMEOUT_S = 60.0
T = TypeVar("T")


class RankFailure(NeffkitError):
    """Another rank died or stopped answering."""

    default_hint = "see the other rank's output; docs/parallelism.md#running-multi-rank-bundles"


def _pack(graph: GraphEntry, meta: dict[str, np.ndarray]) -> torch.Tensor:
    """One torch-owned int64 tensor holding the step's metadata.

    Never broadcast a numpy-backed tensor (torch.from_numpy): when gloo's worker thread drops the
    last reference, freeing it decrefs the numpy array and needs the GIL, which the main thread
    holds while the next graph waits on its all-reduce, queued behind that worker: a deadlock
    that strikes depending on timing.
    """
    parts = []
    for name, _, dtype in graph.meta_specs:
        arr = np.ascontiguousarray(meta[name])
        if dtype == "float32":
            arr = arr.astype(np.float32).view(np.int32)  # bits travel unchanged in an int64
        parts.append(arr.reshape(-1).astype(np.int64))
    return torch.from_numpy(np.concatenate(parts)).clone()


def _unpack(graph: GraphEntry, buf: np.ndarray) -> dict[str, np.ndarray]:
    meta, offset = {}, 0
    for name, shape, dtype in graph.meta_specs:
        size = int(np.prod(shape))
        chunk = buf[offset : offset + size]
        offset += size
        if dtype == "float32":
            meta[name] = chunk.astype(np.int32).view(np.float32).reshape(shape)
        else:
            meta[name] = chunk.reshape(shape).copy()
    return meta


def _packed_size(graph: GraphEntry) -> int:
    return sum(int(np.prod(shape)) for _, shape, _ in graph.meta_specs)


def step_buffer_size(runner: ModelRunner, adapters: bool = False) -> int:
    """One broadcast per step: [command, graph index, metadata of the largest graph]; with
    adapter slots, room for an ADAPTER message too."""
    largest = max(_packed_size(g) for g in runner.graph_list)
    return 2 + max(largest, ADAPTER_WORDS + 1 if adapters else 0)


def _pack_adapter(slot: int, adapter: Adapter | None) -> torch.Tensor:
    """[byte count, the JSON's bytes 8 to a word]: which adapter a slot now holds (None:
    zeros), for every rank to read from its directory and cut for itself."""
    where = [adapter.name, str(adapter.path)] if adapter is not None else None
    data = json.dumps([slot, where]).encode()
    words = -(-len(data) // 8)
    if words > ADAPTER_WORDS:
        raise AdapterError(f"adapter path too long for the other ranks ({len(data)} bytes)")
    raw = np.frombuffer(data.ljust(8 * words, b"\0"), dtype=np.int64)
    return torch.from_numpy(np.concatenate([[len(data)], raw])).clone()


def _write_adapter(slots: AdapterSlots, payload: np.ndarray) -> None:
    """A follower's side of an ADAPTER message: the same adapter read and cut for its ranks."""
    size = int(payload[0])
    slot, where = json.loads(payload[1:].tobytes()[:size])
    adapter = read_adapter(where[0], where[1], slots.lora) if where is not None else None
    slots.write(slot, adapter)


class StepBroadcaster:
    """Rank 0's `ModelRunner.on_run` hook: one broadcast per step (gloo latency dominates)."""

    def __init__(
        self, runner: ModelRunner, group: dist.ProcessGroup, adapters: bool = False
    ) -> None:
        self.runner = runner
        self.group = group
        self.size = step_buffer_size(runner, adapters)
        self._sent: torch.Tensor | None = None  # alive until the next step (freed by us, not gloo)

    def _send(self, command: int, index: int, payload: torch.Tensor | None) -> None:
        buf = torch.zeros(self.size, dtype=torch.int64)
        buf[0], buf[1] = command, index
        if payload is not None:
            buf[2 : 2 + payload.numel()] = payload
        self._sent = buf
        _broadcast(buf, self.group)

    def __call__(self, index: int, meta: dict[str, np.ndarray]) -> None:
        self._send(RUN, index, _pack(self.runner.graph_list[index], meta))

    def adapter(self, slot: int, adapter: Adapter | None) -> None:
        """`AdapterSlots.on_write`: the followers write the same adapter into `slot`."""
        self._send(ADAPTER, 0, _pack_adapter(slot, adapter))

    def stop(self) -> None:
        self._send(STOP, 0, None)


def _peer_exited(procs: list[subprocess.Popen]) -> bool:
    return any(p.poll() is not None for p in procs)


def _is_collective_error(exc: BaseException) -> bool:
    """gloo/nccl transport failures, or a collective call inside an AOTInductor graph."""
    text = str(exc)
    return any(mark in text for mark in ("gloo", "nccl", "c10d", "Connection closed"))


def _broadcast(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    try:
        dist.broadcast(tensor, src=0, group=group)
    except RuntimeError as exc:  # gloo: connection closed / timed out
        raise RankFailure(
            f"rank {dist.get_rank()}: lost contact with the other ranks: {exc}",
            hint="another rank has exited; see its output",
        ) from exc


def follow(runner: ModelRunner, group: dist.ProcessGroup, slots: AdapterSlots | None = None) -> int:
    """A follower's loop: receive each step from rank 0 and run it (or write an adapter into
    its slots). Returns steps run."""
    steps = 0
    buf = torch.zeros(step_buffer_size(runner, slots is not None), dtype=torch.int64)
    while True:
        _broadcast(buf, group)
        if int(buf[0]) == STOP:
            return steps
        if int(buf[0]) == ADAPTER and slots is not None:
            _write_adapter(slots, buf.numpy()[2:])
            continue
        graph = runner.graph_list[int(buf[1])]
        runner.execute(graph, _unpack(graph, buf.numpy()[2:]))
        steps += 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(backend: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the process group from the standard variables (set by torchrun, or by run_ranks).

    Step metadata travels on a separate gloo group. The compiled graphs' collectives run on the
    default group, and their waits hold the GIL; if a metadata broadcast shared that group, its
    worker thread could block on the GIL (releasing a Python-visible tensor) with the graph's
    all-reduce queued behind it: a deadlock that depends on timing. Apart, neither waits on the
    other.
    """
    timeout = timedelta(seconds=timeout_s)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    # Ranks share this host's cores: an intra-op pool per rank sized to every core oversubscribes
    # them, and busy-waiting pools then starve the collectives (measured: 90+ ms/token on 2 cores).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cpus() // local_ranks))
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout)  # the control group


def follower_main(bundle: str, backend: str, timeout_s: float) -> None:
    """Entry point of a follower rank process (`python -m neffkit.runtime.worker.follower`)."""
    control = _init(backend, timeout_s)
    try:
        loaded = load(bundle, rank=dist.get_rank(), world_size=dist.get_world_size())
        follow(loaded.runner, control, loaded.adapters)
    finally:
        dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _start_followers(
    bundle: str | Path, world_size: int, backend: str, timeout_s: float
) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """Ranks 1..N-1 as plain processes joining through env://, exactly as torchrun would start
    them; returns them and the launch variables rank 0 (this process) joins with."""
    launch = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    cmd = [
        sys.executable,
        "-m",
        "neffkit.runtime.worker.follower",
        str(bundle),
        backend,
        str(timeout_s),
    ]
    procs = [
        subprocess.Popen(cmd, env={**os.environ, **launch, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(1, world_size)
    ]
    return procs, launch


@contextmanager
def _peers_lost(procs: list[subprocess.Popen], rank: int, during: str) -> Iterator[None]:
    """A collective that failed inside the block (a graph's, the load's warm-up's: a peer is
    gone) as a RankFailure naming `during`; other errors as they are."""
    try:
        yield
    except RuntimeError as exc:
        if not (_peer_exited(procs) or _is_collective_error(exc)):
            raise
        raise RankFailure(
            f"rank {rank}: lost contact with the other ranks {during}: {exc}",
            hint="another rank has exited; see its output",
        ) from exc


def run_ranks(
    bundle: str | Path,
    world_size: int,
    leader: Callable[[LoadedBundle], T],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
) -> T | None:
    """Run `leader(loaded)` on rank 0 with every other rank following; None on followers.

    Under torchrun this process is one rank of the launch; otherwise it is rank 0 and starts the
    other ranks itself.
    """
    procs: list[subprocess.Popen] = []
    launch: dict[str, str] = {}
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise NeffkitError(
                f"the bundle needs {world_size} ranks; torchrun started {os.environ['WORLD_SIZE']}"
            )
    else:
        procs, launch = _start_followers(bundle, world_size, backend, timeout_s)
    saved_env = dict(os.environ)
    if procs:  # we are rank 0 of our own launch, for as long as it lasts
        os.environ.update(launch, RANK="0", LOCAL_RANK="0")
    rank = int(os.environ["RANK"])
    control = _init(backend, timeout_s)
    try:
        with _peers_lost(procs, rank, "while loading"):  # its warm-up runs every graph
            loaded = load(bundle, rank=rank, world_size=world_size)
        if rank != 0:
            follow(loaded.runner, control, loaded.adapters)
            return None
        broadcaster = StepBroadcaster(loaded.runner, control, loaded.adapters is not None)
        loaded.runner.on_run = broadcaster
        if loaded.adapters is not None:
            loaded.adapters.on_write = broadcaster.adapter
        try:
            with _peers_lost(procs, 0, "during a graph call"):
                return leader(loaded)
        finally:
            try:  # release the followers, also when the leader failed (e.g. a bad request)
                broadcaster.stop()
            except RankFailure:
                pass
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
        for p in procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


def run_on_ranks(
    bundle: str | Path,
    leader: Callable[[LoadedBundle], T],
    executor: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> T | None:
    """`leader(loaded)` on this process's load of the bundle: directly for a one-rank bundle,
    as rank 0 of every rank otherwise (None on followers of a torchrun launch)."""
    world_size = read_bundle(bundle, verify=False).record.world_size
    if (world_size == 1 or executor == "xla-cpu") and not launched_by_torchrun():
        return leader(load(bundle, executor=executor))  # xla-cpu: every rank in this process
    if executor != "auto":
        raise RequestError(
            f"--executor {executor} runs one rank; this bundle has {world_size} ranks"
        )
    return run_ranks(bundle, world_size, leader, timeout_s=timeout_s)
