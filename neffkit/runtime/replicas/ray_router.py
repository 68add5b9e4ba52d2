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

from neffkit.runtime.engine.kv_blocks import BlockHash
from neffkit.runtime.replicas.routing import CACHE_THRESHOLD, SeenBlocks, prompt_chain


def _chain(pending: PendingRequest | None, block_size: int) -> tuple[list[BlockHash], int]:
    """The prompt's block hashes (keyed by its adapter, the call's `adapter` argument) and its
    length; none where the request carries no prompt."""
    if pending is None or not pending.args or not isinstance(pending.args[0], list):
        return [], 0
    prompt = pending.args[0]
    return prompt_chain(prompt, block_size, pending.kwargs.get("adapter")), len(prompt)


class PrefixAffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve's router for neffkit's engine replicas (`request_router_kwargs`: block_size)."""

    def initialize_state(self, block_size: int = 16, **kwargs: Any) -> None:
        self.block_size = block_size
        self.seen: dict[ReplicaID, SeenBlocks] = {}

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
            seen = self.seen.get(replica.replica_id)
            n = seen.matched(chain) if seen is not None else 0
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
        self.seen.setdefault(replica_id, SeenBlocks()).remember(chain)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.seen.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)
