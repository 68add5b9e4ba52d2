"""Decode against the memory roofline on a model of more than 100M parameters.

Batch-1 decode reads every weight once per token (plus the K/V context), so its floor on a CPU is
bytes read ÷ memory read bandwidth. This script measures this machine's read bandwidth (a
multi-threaded reduction over a buffer far larger than the caches), builds a random-weight
134M-parameter Llama (fp32, 12 layers, hidden 768, vocab 32000), times neffkit's decode step, and
reports the achieved fraction of the bandwidth-bound time.

    python bench/roofline.py [--context 64] [--steps 64] [--result roofline]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, decode_step_times, ensure_bundle, parse_args, write_result  # noqa: E402

WORK = REPO / "bench" / "work"


def make_model(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def read_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes/s of a multi-threaded sum over `gib` GiB (best of `repeats`)."""
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=64, help="tokens already in the cache")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--result", default="roofline", help="name of the bench/results/*.json written")
    args = parse_args(ap)
    WORK.mkdir(parents=True, exist_ok=True)
    model = make_model(WORK / "roofline-134m")
    manifest = WORK / "roofline.yaml"
    manifest.write_text(
        f"neffkit: 1\nname: roofline-134m\nmodel: {model}\ndtype: float32\n"
        "kv_cache: {block_size: 16, num_blocks: 24}\n"
        "buckets: {prefill: [64], decode: [1], context: [256]}\nsampling: {max_top_k: 16}\n"
    )
    bundle = ensure_bundle(manifest, WORK / "roofline-bundle")

    from safetensors import safe_open

    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    with safe_open(str(bundle / "weights" / "rank0.safetensors"), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    weight_bytes = sum(4 * torch.Size(s).numel() for s in sizes.values())
    embed = 4 * torch.Size(sizes["model.embed_tokens.weight"]).numel()
    params = weight_bytes // 4
    layers, kv_heads, head_dim = 12, 4, 64
    context = args.context + args.steps // 2  # mean context over the timed steps
    kv_bytes = layers * 2 * context * kv_heads * head_dim * 4
    # one embedding row is read, not the table; the LM head is read whole
    bytes_per_token = weight_bytes - embed + 768 * 4 + kv_bytes

    bandwidth = read_bandwidth()
    llm = LLM(load(bundle))
    prompt = list(range(3, 3 + args.context))
    warm_up = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], warm_up)
    times = decode_step_times(llm.core, [prompt], args.steps)
    measured = statistics.median(times)
    bound = bytes_per_token / bandwidth
    result = {
        "parameters": params,
        "bytes_per_token": bytes_per_token,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "bound_ms": 1e3 * bound,
        "measured_ms": 1e3 * measured,
        "fraction_of_roofline": bound / measured,
        "threads": torch.get_num_threads(),
        "context_tokens": context,
    }
    print(
        f"{params / 1e6:.0f}M parameters, {bytes_per_token / 1e6:.0f} MB read per token; "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s → bound {1e3 * bound:.2f} ms/token; "
        f"neffkit {1e3 * measured:.2f} ms/token = {100 * bound / measured:.0f}% of the roofline"
    )
    print(f"written {write_result(args.result, result)}")


if __name__ == "__main__":
    main()
