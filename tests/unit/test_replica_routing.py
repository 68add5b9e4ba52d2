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
