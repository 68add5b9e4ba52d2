"""Parallel layout arithmetic (tp, ep) and its validation. Pure Python: the manifest uses it.

Errors are ModelErrors naming the manifest field they concern (`field`); the manifest re-raises
them as ManifestErrors with that path, so models/ never depends on the manifest's error type.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffkit.errors import ModelError
from neffkit.models.config import ModelConfig


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    ep: int = 1

    def kv_heads_per_rank(self, cfg: ModelConfig) -> int:
        if cfg.is_mla:  # one latent row per token, kept whole on every rank
            return 1
        return cfg.num_kv_heads // self.tp if cfg.num_kv_heads % self.tp == 0 else 1

    def kv_head_start(self, cfg: ModelConfig, rank: int) -> int:
        if cfg.num_kv_heads % self.tp == 0:
            return rank * self.kv_heads_per_rank(cfg)
        return rank // (self.tp // cfg.num_kv_heads)  # replicated: the head this rank's q uses

    @property
    def moe_tp(self) -> int:
        """Ranks that split one expert's intermediate dimension."""
        return self.tp // self.ep

    def needs_rank_input(self, cfg: ModelConfig) -> bool:
        """Graphs take `rank` as a tensor where they need it: selecting this rank's vocabulary
        shard (tp > 1) and its local experts (ep > 1). As data, so every rank's graph is one."""
        return self.tp > 1 or (cfg.is_moe and self.ep > 1)

    def vocab_rows(self, cfg: ModelConfig) -> int:
        """Rows of the embedding / LM head each rank keeps (the last shard zero-padded)."""
        return -(-cfg.vocab_size // self.tp)


def check_parallelism(cfg: ModelConfig, par: Parallelism) -> None:
    """Layout errors naming the numbers and the manifest field they concern."""
    if cfg.num_heads % par.tp:
        raise ModelError(
            field="parallel.tp",
            message=f"{par.tp} does not divide the model's {cfg.num_heads} attention heads",
        )
    kv = cfg.num_kv_heads
    if kv % par.tp and par.tp % kv:
        raise ModelError(
            field="parallel.tp",
            message=f"{par.tp} and the model's {kv} KV heads do not divide one another",
        )
    if any(not s for s in cfg.sparse_layers) or not cfg.is_moe:
        if cfg.intermediate_size % par.tp:
            raise ModelError(
                field="parallel.tp",
                message=f"{par.tp} does not divide the model's "
                f"intermediate_size {cfg.intermediate_size}",
            )
    if cfg.is_moe:
        if cfg.num_experts % par.ep:
            raise ModelError(
                field="parallel.ep",
                message=f"{par.ep} does not divide the model's {cfg.num_experts} experts",
            )
        if cfg.shared_intermediate_size % par.tp:
            raise ModelError(
                field="parallel.tp",
                message=f"{par.tp} does not divide the shared experts' intermediate size "
                f"{cfg.shared_intermediate_size}",
            )
        if cfg.moe_intermediate_size % par.moe_tp:
            raise ModelError(
                field="parallel",
                message=f"tp/ep = {par.moe_tp} does not divide the experts' "
                f"intermediate size {cfg.moe_intermediate_size}",
            )
    elif par.ep > 1:
        raise ModelError(
            field="parallel.ep", message=f"{par.ep} > 1 needs a mixture-of-experts model"
        )
