"""Offline generation for `neffkit run --prompt`: load, generate, report outputs and timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neffkit.bundle import read_bundle
from neffkit.errors import RequestError
from neffkit.runtime.distributed import DEFAULT_TIMEOUT_S, launched_by_torchrun, run_ranks
from neffkit.runtime.engine import SamplingParams
from neffkit.runtime.loader import LoadedBundle, load


@dataclass(frozen=True)
class GenerateRequest:
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


def generate(
    bundle_path: Path,
    request: GenerateRequest,
    dist_timeout_s: float = DEFAULT_TIMEOUT_S,
    executor: str = "auto",
) -> dict[str, Any] | None:
    """Prompts run together (continuous batching); outputs come back in the order given.

    A bundle built for several ranks runs one process per rank (rank 0 returns the report, other
    ranks of a torchrun launch return None).
    """
    if not request.texts and not request.token_ids:
        raise RequestError("nothing to generate: give --prompt TEXT or --prompt-ids 1,2,3")
    world_size = read_bundle(bundle_path, verify=False).record.world_size
    if world_size > 1 or launched_by_torchrun():
        if executor != "auto":
            raise RequestError(
                f"--executor {executor} runs one rank; this bundle has {world_size} ranks"
            )
        return run_ranks(
            bundle_path,
            world_size,
            lambda loaded: _generate(loaded, request),
            timeout_s=dist_timeout_s,
        )
    return _generate(load(bundle_path, executor=executor), request)


def _generate(loaded: LoadedBundle, request: GenerateRequest) -> dict[str, Any]:
    tok = loaded.tokenizer
    if request.texts and tok is None:
        raise RequestError("this bundle has no tokenizer: use --prompt-ids")
    prompts = [tok.encode(t) for t in request.texts] if request.texts else []
    prompts += request.token_ids
    params = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
    )
    engine = loaded.engine
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    t = engine.timings
    return {
        "outputs": [
            {
                "token_ids": s.output_ids,
                "text": tok.decode(s.output_ids) if tok else None,
                "finish_reason": s.finish_reason,
            }
            for s in seqs
        ],
        "timings": {
            "load_s": round(loaded.load_seconds, 4),
            "prefill_s": round(t.prefill_s, 4),
            "decode_s": round(t.decode_s, 4),
            "decode_tokens": t.decode_tokens,
            "decode_ms_per_token": round(1000 * t.decode_s / max(t.decode_steps, 1), 4),
            "wall_s": round(wall, 4),
        },
    }
