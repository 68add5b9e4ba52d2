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


class _FakeClient:
    """An engine client whose core the test kills: its live streams then end with "error"."""

    def __init__(self) -> None:
        self.streams: list = []
        self.aborted: list = []
        self.failure: str | None = None

    @property
    def healthy(self) -> bool:
        return self.failure is None

    def outstanding_tokens(self) -> int:
        return sum(not s.done for s in self.streams)

    def submit(self, prompt_ids, params, stop, emit, include_stop, adapter, priority):
        from neffkit.runtime.engine.core_client import Stream

        stream = Stream(
            rid=len(self.streams), prompt_ids=prompt_ids, params=params, emit=emit, detok=None
        )
        self.streams.append(stream)
        return stream

    def abort(self, stream, reason="abort") -> None:
        self.aborted.append(stream)

    def die(self) -> None:
        from neffkit.runtime.engine.core_client import Event

        self.failure = "killed"
        for s in self.streams:
            s.done = True
            s.emit(Event("killed", [], finish_reason="error"))

    def stop(self) -> None:
        pass


def test_a_request_that_lost_its_replica_before_a_token_moves_and_one_after_fails():
    from neffkit.contract.records import BucketLists
    from neffkit.runtime.engine.core_client import Event, ServerBusy
    from neffkit.runtime.replicas.group import EngineGroup
    from neffkit.runtime.sampling_params import SamplingParams
    from tests.fake_model import scheduler_config

    config = scheduler_config(8, 33, BucketLists((8,), (1,), (32,)))
    group = EngineGroup(lambda *_: _FakeClient(), [(0,), (1,)], config, "m", 8, {})
    group.start()
    params = SamplingParams(max_tokens=4)
    try:
        a, b = group.replicas[0].client, group.replicas[1].client
        moved: list = []
        lost: list = []
        first = group.submit([1] * 20, params, (), moved.append)
        second = group.submit([2] * 20, params, (), lost.append)
        third = group.submit([3] * 20, params, (), lambda e: None)
        assert (first.engine, second.engine, third.engine) == (0, 1, 0)
        b.streams[0].emit(Event("z", [7]))  # `second` produced a token on replica 1
        a.die()  # replica 0 dies before `first` and `third` produced one: both move
        assert moved == [] and [s.prompt_ids[0] for s in b.streams] == [2, 1, 3]
        group.abort(third)  # the caller's stream: its request's current one is aborted
        assert b.aborted == [b.streams[2]]
        b.streams[1].emit(Event("y", [6], finish_reason="length"))
        assert [e.token_ids for e in moved] == [[6]]  # the caller hears the new replica
        b.die()  # `second`'s caller saw a token: it ends with the cause
        assert [e.finish_reason for e in lost] == [None, "error"]
        with pytest.raises(ServerBusy):  # no replica serving
            group.submit([4] * 20, params, (), lambda e: None)
    finally:
        group.stop()
