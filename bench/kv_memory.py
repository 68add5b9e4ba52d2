"""How many sequences one KV budget holds with sliding-window layers in pools of their own.

Gemma 3 270M (the Q4_K_M GGUF file of bench/classes.py, read as `model:`; 3 full and 15 sliding
layers, window 512) at context 8192 with `kv_cache.memory_mb` fixed, built twice: `hybrid: true`
(KV groups) and `hybrid: false` (every layer's cache over the whole context, as before groups).
For each bundle it reads the cache tensors the graphs take (bundle.json) and drives neffkit's
own scheduler over the bundle's recorded pools with N requests of L tokens (4096, then 8192):
L - 512 prompt tokens and 512 output tokens. Each step's prefill chunks and decode rows are
scheduled as in the engine, and what a graph would compute is skipped (how many sequences the
pools hold does not depend on the values). It reports the most requests admitted at once
(holding their prompt's blocks), the most decoding at once, and the preemptions.

    python bench/kv_memory.py            # writes bench/results/kv_memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from classes import WORK, gemma3_q4_k_m
from common import ensure_bundle, machine_description, parse_args, write_result

from neffkit.contract import abi
from neffkit.contract.read import read_bundle
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.scheduler import Scheduler
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.step_output import StepOutput

CONTEXT, MEMORY_MB, OUTPUT = 8192, 1024, 512
MANIFEST = """neffkit: 1
name: gemma3-kv-{name}
model: {model}
dtype: float32
buckets: {{prefill: [256], decode: [8], context: [{context}]}}
kv_cache: {{memory_mb: {memory}, hybrid: {hybrid}}}
"""


def build(hybrid: bool) -> Path:
    name = "hybrid" if hybrid else "one-pool"
    manifest = WORK / f"gemma3-kv-{name}.yaml"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    text = MANIFEST.format(
        name=name,
        model=gemma3_q4_k_m(),
        context=CONTEXT,
        memory=MEMORY_MB,
        hybrid=str(hybrid).lower(),
    )
    manifest.write_text(text)
    return ensure_bundle(manifest, WORK / f"gemma3-kv-{name}")


def _output(rows: int) -> StepOutput:
    """What a graph would return, zeros: the scheduler reads the sampled tokens only."""
    return StepOutput({abi.NEXT_TOKENS: np.zeros(rows, np.int64)})


def held_at_once(config: SchedulerConfig, requests: int, tokens: int) -> dict[str, int]:
    """Drive the scheduler over `requests` sequences of `tokens` tokens to the end; the most
    admitted at once (prefilling or decoding), the most decoding at once, the preemptions."""
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(requests):
        ids = rng.integers(3, 200_000, tokens - OUTPUT).tolist()
        sched.add(SequenceState(i, ids, params, seed=0))
    most = decoding = steps = 0
    while sched.has_work():
        sched.admit()
        most = max(most, len(sched.running) + len(sched.prefilling))
        decoding = max(decoding, len(sched.running))
        prefill = sched.next_prefill()
        if prefill is not None:
            sched.prefilled(prefill, _output(prefill.batch))
        batch = sched.next_decode()
        if batch is not None:
            sched.decoded(batch, _output(batch.batch))
        steps += 1
    return {
        "most_at_once": most,
        "most_decoding": decoding,
        "preemptions": sched.preemptions,
        "steps": steps,
    }


def cache_tensors(bundle: Path) -> dict[str, Any]:
    """The cache inputs of the decode graph as bundle.json records them: blocks per tensor."""
    record = json.loads((bundle / "bundle.json").read_text())
    graph = next(g for g in record["graphs"] if g["phase"] == "decode")
    caches = [i for i in graph["inputs"] if abi.is_kv_cache(i["name"])]
    return {
        "groups": record["layout"].get("kv_groups", []),
        "blocks_per_tensor": [i["shape"][0] for i in caches],
        "cache_bytes": sum(int(np.prod(i["shape"])) * 4 for i in caches),  # float32
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    args = parse_args(ap)
    rows: dict[str, Any] = {}
    for hybrid in (False, True):
        bundle = build(hybrid)
        config = SchedulerConfig.of(read_bundle(bundle).record)
        key = "kv_groups" if hybrid else "one_pool"
        rows[key] = {
            **cache_tensors(bundle),
            **{f"tokens_{n}": held_at_once(config, args.requests, n) for n in (4096, CONTEXT)},
        }
        print(key, json.dumps({k: v for k, v in rows[key].items() if k.startswith("tokens")}))
    ratios = {
        f"tokens_{n}": {
            what: rows["kv_groups"][f"tokens_{n}"][what] / rows["one_pool"][f"tokens_{n}"][what]
            for what in ("most_at_once", "most_decoding")
        }
        for n in (4096, CONTEXT)
    }
    result = {
        "machine": machine_description(),
        "command": "python bench/kv_memory.py",
        "model": "Gemma 3 270M Q4_K_M GGUF, float32 KV cache",
        "context": CONTEXT,
        "memory_mb": MEMORY_MB,
        "output_tokens": OUTPUT,
        "requests": args.requests,
        "rows": rows,
        "ratios": ratios,
    }
    print(f"written {write_result('kv_memory', result)}: {ratios}")


if __name__ == "__main__":
    main()
