"""The parallel layout (tp, ep): one value for the manifest, the build and the graphs.

How a model's heads, experts and vocabulary split over it is the model's own knowledge
(ModelConfig.kv_heads_per_rank, check_parallelism, ...). Pure Python; imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    ep: int = 1
    # compile one artifact per rank where ranks trace different graphs, instead of failing the
    # build with SPMDMismatchError (manifest `parallel.per_rank_artifacts`; counted, shown)
    per_rank_artifacts: bool = False

    @property
    def moe_tp(self) -> int:
        """Ranks that split one expert's intermediate dimension."""
        return self.tp // self.ep
