"""Data-parallel routing (replicas/routing.py) and CPU shares (replicas/group.py)."""

from __future__ import annotations

import os

import pytest

from neffkit.errors import NeffkitError
from neffkit.runtime.replicas.group import replica_cpus
from neffkit.runtime.replicas.routing import BALANCE_TOKENS, PrefixRouter

BS = 16
PREFIX = list(range(100, 164))  # four blocks


def test_without_a_cached_prefix_the_least_loaded_replica_serves():
    router = PrefixRouter(3, BS)
    assert router.choose(list(range(40)), [500, 20, 300], None) == 1
    assert router.choose([7] * 40, [0, 0, 0], None) == 0  # ties: the first


def test_a_prompt_follows_the_replica_that_holds_its_prefix():
    router = PrefixRouter(2, BS)
    first = router.choose([*PREFIX, 1, 2], [0, 0], None)
    other = 1 - first
    loads = [0, 0]
    loads[first] = 900  # busier, but not by the balance thresholds
    assert router.choose([*PREFIX, 3, 4, 5], loads, None) == first
    # another adapter's blocks are other blocks: no match, the least loaded
    assert router.choose([*PREFIX, 3, 4, 5], loads, "sql") == other
    # under half the prompt cached: by load
    assert router.choose([*PREFIX, *range(500, 600)], loads, None) == other


def test_a_far_busier_replica_loses_its_prefix_to_balance():
    router = PrefixRouter(2, BS)
    first = router.choose([*PREFIX, 1], [0, 0], None)
    loads = [0, 0]
    loads[first] = BALANCE_TOKENS + 100
    assert router.choose([*PREFIX, 2], loads, None) == 1 - first


def test_a_replica_down_is_never_chosen_and_a_restarted_one_forgets():
    router = PrefixRouter(2, BS)
    assert router.choose([*PREFIX, 1], [None, 50], None) == 1
    assert router.choose([*PREFIX, 2], [0, 50], None) == 1  # its cache holds the prefix
    router.forget(1)
    assert router.choose([*PREFIX, 3], [0, 50], None) == 0


def test_cpu_shares_are_contiguous_and_cover_the_mask():
    cpus = sorted(os.sched_getaffinity(0))
    shares = replica_cpus(len(cpus))
    assert [c for share in shares for c in share] == cpus
    assert all(len(share) == 1 for share in shares)
    with pytest.raises(NeffkitError, match="each replica needs one at least"):
        replica_cpus(len(cpus) + 1)


class _DeadCore:
    """A core process that has exited (what the client's reader thread finds)."""

    exitcode = -9

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


def test_a_dead_clients_streams_are_done_and_aborting_one_sends_nothing():
    """A replica restarts with a new client whose request ids start again: an abort of a
    stream the dead client ended must not reach it (it would abort another request)."""
    import threading
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from neffkit.contract.records import BucketLists
    from neffkit.runtime.engine.core_client import EngineClient
    from neffkit.runtime.engine.metrics import Metrics
    from neffkit.runtime.sampling_params import SamplingParams
    from tests.fake_model import scheduler_config

    config = scheduler_config(8, 33, BucketLists((8,), (1,), (32,)))
    ours, theirs = Pipe()
    failed = threading.Event()
    client = EngineClient(
        _DeadCore(), ours, config, None, Metrics("m"), on_failure=lambda _: failed.set()
    )  # type: ignore[arg-type]
    theirs.send(("ready", 32))
    client.start()
    events: list = []
    stream = client.submit([1, 2, 3], SamplingParams(max_tokens=2), (), events.append)
    assert theirs.recv()[0] == "add"
    theirs.close()  # the core is gone
    assert failed.wait(10)
    assert stream.done and events[-1].finish_reason == "error"
    sent: list = []
    client.conn = SimpleNamespace(send=sent.append)  # type: ignore[assignment]
    client.abort(stream)
    assert sent == []
