"""The build's worker pool: a keyed job runs in the worker that ran its key (a graph's compile
where it was traced), and no worker idles while another's jobs wait."""

from __future__ import annotations

import os

from neffkit.compile.jobs.workers import worker_pool
from neffkit.compile.progress import Progress


def test_a_keyed_job_runs_where_its_key_ran_and_idle_workers_take_the_rest() -> None:
    quiet = Progress(enabled=False)
    with worker_pool(2) as run:
        first = run(os.getpid, [(), ()], ["a", "b"], quiet, keys=["a", "b"])
        assert len(set(first)) == 2  # one job a worker
        # both workers idle: each takes the job whose key it ran, whatever the order
        again = run(os.getpid, [(), ()], ["b", "a"], quiet, keys=["b", "a"])
        assert again == first[::-1]
        # three jobs of a's worker: the other worker takes one rather than wait
        busy = run(os.getpid, [(), (), ()], ["a1", "a2", "a3"], quiet, keys=["a", "a", "a"])
        assert set(busy) == set(first)
        unkeyed = run(os.getpid, [(), ()], ["x", "y"], quiet)
        assert set(unkeyed) <= set(first)
