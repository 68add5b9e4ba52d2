"""Trace and compile jobs as Ray tasks (`neffkit build --cluster ADDRESS`): the build's worker
pool spread over a Ray cluster instead of this host's processes.

Same contract as workers.worker_pool: run(fn, arg tuples, names, progress) → results in order.
Each job is a task that declares its CPU and memory (one CPU; 1 GiB plus twice one rank's weight
bytes), so Ray never starts more of them on a node than its resources hold. A task whose worker
or node dies is retried elsewhere (Ray's `max_retries`); an error raised by the job itself (a
trace or compile failure) is not retried and ends the build as a local one would. What a job
writes (an AOTInductor package, a NEFF) is read on the worker and sent back with its result, so
worker nodes need no shared staging directory for cpu/cuda packages; they do need the model
directory at the same path (a shared filesystem), as every rank of a build reads the checkpoint,
and a neuron build's compile jobs read the lowered HLO from the staging directory (shared too).
Results and the shared artifact cache then work as in a local build.

Ray is an optional dependency (`pip install 'neffkit[cluster]'`), imported only here.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from neffkit.compile.jobs.workers import build_threads
from neffkit.compile.progress import Progress
from neffkit.errors import BuildError

GIB = 1 << 30
RETRIES = 3  # per task, on a lost worker or node


def host_id() -> str:
    """This machine: its hostname and, where there is one, its systemd machine id."""
    machine = Path("/etc/machine-id")
    return socket.gethostname() + (":" + machine.read_text().strip() if machine.exists() else "")


def _remote_call(
    fn: Callable[..., Any], args: tuple, threads: int, driver_host: str
) -> tuple[Any, bytes | None, str]:
    """Run one job on a Ray worker: (its result, the file it wrote, "node-ip node-id").

    `threads` is the driver's build thread count (workers.build_threads): Ray gives a one-CPU
    task one thread, and Inductor writes the thread count into the kernels it generates (their
    OpenMP regions), so without it a cluster build would differ from a local one and run
    single-threaded. On another machine than the driver's, the staging directories a job
    writes under are made for it and removed after its file has been read."""
    import ray
    import torch

    from neffkit.compile.jobs.workers import quiet_warnings

    quiet_warnings()
    torch.set_num_threads(threads)
    made: list[Path] = []
    if host_id() != driver_host:
        for arg in args:
            if isinstance(arg, Path) and arg.suffix:
                made += [p for p in reversed(arg.parents) if not p.exists()]
                arg.parent.mkdir(parents=True, exist_ok=True)
    try:
        value = fn(*args)
        artifact = getattr(value, "artifact", None)
        data = Path(artifact).read_bytes() if isinstance(artifact, Path) else None
    finally:
        if made:  # another machine's staging path: leave nothing of it here
            for arg in args:
                if isinstance(arg, Path) and arg.suffix:
                    arg.unlink(missing_ok=True)
            for path in reversed(made):  # deepest first; a directory still in use stays
                try:
                    path.rmdir()
                except OSError:
                    pass
    node = f"{ray.util.get_node_ip_address()} {ray.get_runtime_context().get_node_id()[:12]}"
    return value, data, node


def _connect(address: str) -> Any:
    """Ray, connected to the cluster at `address` ("auto", "HOST:PORT", "ray://HOST:PORT")."""
    try:
        import ray
    except ImportError:
        raise BuildError(
            "--cluster needs Ray, which is not installed",
            hint="pip install 'neffkit[cluster]'",
        ) from None
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as exc:  # no cluster there, or a version mismatch: say which
        raise BuildError(
            f"--cluster {address}: cannot connect ({type(exc).__name__}: {exc})"
        ) from None
    return ray


def _land(value: Any, data: bytes | None) -> None:
    """A job's file, back at the path the build expects (unless it is there already)."""
    if data is None:
        return
    path = Path(value.artifact)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


@contextmanager
def ray_pool(
    address: str, task_memory: int, nodes: Counter[str] | None = None
) -> Iterator[Callable[..., list[Any]]]:
    """Connect to the Ray cluster at `address` and yield run(); `nodes` counts finished tasks
    per node address (the build report's)."""
    ray = _connect(address)
    remote = ray.remote(_remote_call).options(
        num_cpus=1, memory=task_memory, max_retries=RETRIES, retry_exceptions=False
    )
    counts = nodes if nodes is not None else Counter()
    threads, driver = build_threads(), host_id()

    # `keys` (which worker a job prefers, worker_pool's) does not apply: Ray places its tasks
    def run(
        fn: Callable[..., Any],
        arg_list: list[tuple],
        names: list[str],
        progress: Progress,
        keys: list[Any] | None = None,
    ) -> list:
        refs = {remote.remote(fn, args, threads, driver): i for i, args in enumerate(arg_list)}
        results: list[Any] = [None] * len(arg_list)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            index = refs[done[0]]
            try:
                value, data, node = ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:  # the job's own error: as if local
                raise exc.as_instanceof_cause() from None
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as exc:
                raise BuildError(
                    f"{names[index]}: lost its Ray worker {RETRIES + 1} times "
                    f"({type(exc).__name__}: {exc})",
                    hint="check the cluster's nodes (ray status)",
                ) from None
            _land(value, data)
            results[index] = value
            counts[node] += 1
            progress.done(names[index], getattr(value, "seconds", None))
        return results

    try:
        yield run
    finally:
        ray.shutdown()


def task_memory(weight_bytes_per_rank: int) -> int:
    """Memory one trace or compile task declares: 1 GiB plus twice one rank's weights (the
    traced program holds them, and AOTInductor reads them while compiling)."""
    return GIB + 2 * weight_bytes_per_rank
