"""Per-token decode latency: neffkit bundle vs HF transformers eager vs torch.compile of HF.

Same checkpoint, same dtype (float32), same process and thread count; the three runs alternate for
`--rounds` rounds and medians are reported with ratios. Usage:

    python bench/decode.py [--manifest manifests/demo.yaml] [--batch 1 4] [--steps 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    REPO,
    HFDecoder,
    decode_step_times,
    ensure_bundle,
    machine_description,
    median,
    parse_args,
    write_result,
)

from neffkit.runtime.engine.core import EngineCore  # noqa: E402
from neffkit.runtime.engine.loading import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "demo.yaml")
    parser.add_argument("--bundle", type=Path, default=REPO / "bundles" / "demo-llama")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parse_args(parser)

    bundle = ensure_bundle(args.manifest, args.bundle)
    loaded = load(bundle)
    model_dir = Path(loaded.bundle.record.manifest.model)
    max_len = args.prompt_len + args.steps + 8
    eager = HFDecoder(model_dir, compiled=False, max_len=max_len)
    compiled = HFDecoder(model_dir, compiled=True, max_len=max_len)
    vocab = loaded.bundle.record.model.vocab_size
    rng = np.random.default_rng(0)

    rows = []
    for batch in args.batch:
        prompts = rng.integers(1, vocab, size=(batch, args.prompt_len))
        prompt_t = torch.tensor(prompts)
        compiled.decode_times(prompt_t, 4)  # compile + warm-up, not timed
        samples = {"neffkit": [], "hf_eager": [], "hf_compile": []}
        for _ in range(args.rounds):
            samples["neffkit"] += decode_step_times(
                EngineCore(loaded.runner), prompts.tolist(), args.steps
            )
            samples["hf_eager"] += eager.decode_times(prompt_t, args.steps)
            samples["hf_compile"] += compiled.decode_times(prompt_t, args.steps)
        ms = {k: 1000 * median(v) for k, v in samples.items()}
        rows.append(
            {
                "batch": batch,
                "ms_per_step": ms,
                "speedup_vs_hf_eager": ms["hf_eager"] / ms["neffkit"],
                "speedup_vs_hf_compile": ms["hf_compile"] / ms["neffkit"],
            }
        )

    print(
        f"decode latency per step (median of {args.rounds}x{args.steps} steps), "
        f"{machine_description()['cpu']}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'batch':>5} {'neffkit ms':>11} {'HF eager ms':>12} {'HF compile ms':>14} "
        f"{'vs eager':>9} {'vs compile':>11}"
    )
    for r in rows:
        m = r["ms_per_step"]
        print(
            f"{r['batch']:>5} {m['neffkit']:>11.3f} {m['hf_eager']:>12.3f} {m['hf_compile']:>14.3f}"
            f" {r['speedup_vs_hf_eager']:>8.2f}x {r['speedup_vs_hf_compile']:>10.2f}x"
        )
    path = write_result(
        "decode",
        {"bundle": str(bundle), "steps": args.steps, "prompt_len": args.prompt_len, "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
