"""Prefix affinity as a Ray Serve request router (Ray Serve's `RequestRouter` API): a request
goes first to the replica that has seen most of its prompt's leading KV blocks (the engine's own
chained block hashes, routing.py), where that is at least half the prompt; Ray Serve then takes
it if the replica has room (`max_ongoing_requests`), else the next rank: two replicas by the
power of two choices, least queued first. A prompt is remembered on the replica it was routed
to; a replica that dies is forgotten.

The request's first argument is its prompt's token ids (ray_serve.py's `EngineReplica.generate`).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from neffkit.runtime.engine.kv_blocks import BlockHash, extend_hashes
from neffkit.runtime.replicas.routing import CACHE_THRESHOLD, REMEMBERED_BLOCKS


def _chain(pending: PendingRequest | None, block_size: int) -> tuple[list[BlockHash], int]:
    """The prompt's block hashes (keyed by its adapter, the second argument's `adapter`) and its
    length; none where the request carries no prompt."""
    if pending is None or not pending.args or not isinstance(pending.args[0], list):
        return [], 0
    prompt, key = pending.args[0], pending.kwargs.get("adapter")
    chain: list[BlockHash] = []
    extend_hashes(chain, prompt, block_size, key)
    return chain, len(prompt)


class PrefixAffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve's router for neffkit's engine replicas (`request_router_kwargs`: block_size)."""

    def initialize_state(self, block_size: int = 16, **kwargs: Any) -> None:
        self.block_size = block_size
        self.seen: dict[ReplicaID, OrderedDict[BlockHash, None]] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        chain, length = _chain(pending_request, self.block_size)
        best, matched = None, 0
        for replica in candidate_replicas:
            n = self._matched(replica.replica_id, chain)
            if n > matched:
                best, matched = replica, n
        others = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        if best is not None and matched * self.block_size >= CACHE_THRESHOLD * length:
            return [[best], [r for r in others if r is not best] or others]
        return [others]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        chain, _ = _chain(pending_request, self.block_size)
        seen = self.seen.setdefault(replica_id, OrderedDict())
        for h in reversed(chain):  # a prompt's first blocks the most recent: evicted last
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > REMEMBERED_BLOCKS:
            seen.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.seen.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    def _matched(self, replica_id: ReplicaID, chain: list[BlockHash]) -> int:
        seen = self.seen.get(replica_id)
        if seen is None:
            return 0
        for n, h in enumerate(chain):
            if h not in seen:
                return n
        return len(chain)
