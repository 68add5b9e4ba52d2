"""Worker processes of a build: trace and compile jobs, and the pool that runs them.

Processes, not threads: tracing holds global state (the fake process group, export's tracing
context). The pool starts lazily, ignores Ctrl-C in workers (the parent decides), and turns
SIGTERM into KeyboardInterrupt so both end the same way: workers terminated, the caller's staging
directory removed.
"""

from __future__ import annotations

import gc
import multiprocessing
import queue
import signal
import sys
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

from neffkit.compile.backends import get_backend
from neffkit.compile.progress import Progress
from neffkit.compile.trace import release_fake_process_group, trace_graph, trace_result
from neffkit.compile.units import GraphSpec, ModelLayout, Traced, TraceResult
from neffkit.errors import BuildError
from neffkit.platform.cpus import torch_threads, usable_cpus


def quiet_warnings() -> None:
    # torch's own pytree deprecation noise, emitted while AOTInductor pickles specs
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def build_threads() -> int:
    """The intra-op thread count every trace and compile of a build runs with, wherever it runs:
    the CPUs the build may use (affinity and cgroup quota). Inductor writes the count into the
    kernels it generates (at 1 it writes no parallel regions at all), so a build must not
    inherit whatever its caller set torch to (an engine that ran in the same process, a
    container's OMP_NUM_THREADS=1)."""
    return usable_cpus()


def _worker_init(threads: int) -> None:
    import torch

    quiet_warnings()
    torch.set_num_threads(threads)
    # Ctrl-C goes to the whole process group: the parent decides, workers are terminated by it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# Programs this process traced in the current build, by (graph name, rank, sha256): a compile
# job in the same process (a -j 1 build) takes its program from here instead of tracing it again
# (the sha it was checked by is the program's own). Cleared when the build's pool closes.
_traced_here: dict[tuple[str, int, str], Traced] = {}


def trace_job(layout: ModelLayout, spec: GraphSpec, rank: int, target: str) -> TraceResult:
    """Trace one graph on one rank, and lower it where the target compiles a lowered form."""
    t0 = time.perf_counter()
    traced = trace_graph(layout, spec, rank)
    lowered = get_backend(target).lower(traced, layout.par.tp)
    if lowered is None:  # the backend compiles the program itself: keep it for its compile
        _traced_here[(spec.name, rank, traced.graph_sha256)] = traced
    return trace_result(traced, round(time.perf_counter() - t0, 3), lowered)


def traced_program(layout: ModelLayout, spec: GraphSpec, rank: int, sha256: str) -> Traced:
    """The program of graph `spec` on `rank` whose canonical text hashes to `sha256`: the one
    this process traced, else traced again here and checked against the sha (so the artifact is
    provably built from the graph that was checked)."""
    traced = _traced_here.pop((spec.name, rank, sha256), None) or trace_graph(layout, spec, rank)
    if traced.graph_sha256 != sha256:
        raise BuildError(
            f"{spec.name}: tracing is not deterministic (the graph changed between "
            "the trace and compile steps)"
        )
    return traced


def _call(args: tuple[Callable[..., Any], int, tuple]) -> tuple[int, Any]:
    fn, index, fn_args = args
    return index, fn(*fn_args)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker with its leak warning silenced.

    Workers terminated mid-compile (Ctrl-C, SIGTERM) cannot unregister the semaphores they made;
    the tracker unlinks them, which is the cleanup we want, but then prints a multi-line
    "leaked semaphore" warning after our one-line message. The tracker takes its warning filters
    from sys.warnoptions when it starts (checked on CPython 3.10-3.12).
    """
    from multiprocessing import resource_tracker

    option = "ignore::UserWarning:multiprocessing.resource_tracker"
    sys.warnoptions.append(option)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(option)


class _Workers:
    """One single-process pool a worker, so that a job can go to the worker of its choice: a
    compile job runs where its graph was traced, whose program is still there (_traced_here),
    instead of tracing it again elsewhere (about a fifth of a cpu graph's build). A job with a
    key runs where the last job with that key ran; a worker with none of its own takes one no
    worker ran, then another's (tracing again beats waiting)."""

    def __init__(self, count: int) -> None:
        _start_quiet_resource_tracker()
        ctx = multiprocessing.get_context("spawn")
        self.pools = [
            ctx.Pool(processes=1, initializer=_worker_init, initargs=(build_threads(),))
            for _ in range(count)
        ]
        self.where: dict[Hashable, int] = {}

    def run(
        self,
        fn: Callable[..., Any],
        arg_list: list[tuple],
        names: list[str],
        progress: Progress,
        keys: list[Hashable] | None,
    ) -> list[Any]:
        results: list[Any] = [None] * len(arg_list)
        done: queue.SimpleQueue = queue.SimpleQueue()
        pending, idle, busy = list(range(len(arg_list))), list(range(len(self.pools))), 0
        while pending or busy:
            while idle and pending:
                worker = idle.pop(0)
                index = self._pick(worker, pending, keys)
                pending.remove(index)
                callback, error_callback = _reporters(done, worker)
                self.pools[worker].apply_async(
                    _call,
                    ((fn, index, arg_list[index]),),
                    callback=callback,
                    error_callback=error_callback,
                )
                busy += 1
            worker, value, exc = _next(done)
            busy -= 1
            idle.append(worker)
            if exc is not None:
                raise exc
            index, result = value
            results[index] = result
            if keys is not None:
                self.where[keys[index]] = worker
            progress.done(names[index], _seconds(result))
        return results

    def _pick(self, worker: int, pending: list[int], keys: list[Hashable] | None) -> int:
        if keys is not None:
            for owner in (worker, None):
                for index in pending:
                    if self.where.get(keys[index]) == owner:
                        return index
        return pending[0]

    def close(self, terminate: bool) -> None:
        for pool in self.pools:
            pool.terminate() if terminate else pool.close()
        for pool in self.pools:
            pool.join()


def _reporters(
    done: queue.SimpleQueue, worker: int
) -> tuple[Callable[[Any], None], Callable[[BaseException], None]]:
    """A job's callbacks on `worker`: its value, or its exception, put on `done`."""
    return lambda value: done.put((worker, value, None)), lambda exc: done.put((worker, None, exc))


def _next(done: queue.SimpleQueue) -> tuple[int, Any, BaseException | None]:
    """The next finished job; waits in short slices so Ctrl-C and SIGTERM interrupt it."""
    while True:
        try:
            return done.get(timeout=0.2)
        except queue.Empty:
            continue


@contextmanager
def worker_pool(jobs: int) -> Iterator[Callable[..., list[Any]]]:
    """Yield run(fn, arg_tuples, names, progress, keys=None) → results in order; workers start
    lazily. `keys`: each job's key, so that a later job with the same key runs in the same
    worker (a graph's compile where it was traced).

    SIGTERM is turned into KeyboardInterrupt so both end the same way: workers terminated, staging
    directory removed by the caller's context managers, nothing left at the destination.
    """
    workers: _Workers | None = None
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)

    def run(
        fn: Callable[..., Any],
        arg_list: list[tuple],
        names: list[str],
        progress: Progress,
        keys: list[Hashable] | None = None,
    ) -> list:
        nonlocal workers
        if jobs <= 1 or (workers is None and len(arg_list) <= 1):
            results: list[Any] = [None] * len(arg_list)
            quiet_warnings()  # the jobs run here, in the main process
            with torch_threads(build_threads()):
                for i, args in enumerate(arg_list):
                    results[i] = fn(*args)
                    progress.done(names[i], _seconds(results[i]))
            return results
        if workers is None:
            workers = _Workers(min(jobs, len(arg_list)))
        return workers.run(fn, arg_list, names, progress, keys)

    try:
        yield run
    except BaseException:
        if workers is not None:
            workers.close(terminate=True)
            # release the pools' queues now (their semaphores), not at interpreter exit, where
            # the resource tracker would report them as leaked
            workers = None
            gc.collect()
        raise
    finally:
        _traced_here.clear()
        release_fake_process_group()
        signal.signal(signal.SIGTERM, previous)
        if workers is not None:
            workers.close(terminate=False)


def _seconds(value: Any) -> float | None:
    """A job's own seconds (TraceResult, Compiled, NeffRun all carry them)."""
    return getattr(value, "seconds", None)
