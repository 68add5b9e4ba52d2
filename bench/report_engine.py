"""The performance page's sections on one engine's speed, each from its bench/results/*.json:
the decode step against HF transformers, the host work around the graph call, the roofline, the
TTFT/TPOT matrix, batch scaling and the kernel's compute ceiling, a burst of arrivals, MoE and MLA
decode, and tensor parallelism on CPU. bench/report.py puts them in order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_format import cpu, table  # noqa: E402


def decode(d: dict[str, Any]) -> str:
    rows = [
        [
            r["batch"],
            f"{r['ms_per_step']['neffkit']:.3f}",
            f"{r['ms_per_step']['hf_eager']:.3f}",
            f"{r['ms_per_step']['hf_compile']:.3f}",
            f"{r['speedup_vs_hf_eager']:.2f}×",
            f"{r['speedup_vs_hf_compile']:.2f}×",
        ]
        for r in d["rows"]
    ]
    return (
        "**Decode latency** (`bench/decode.py`): per decode step, host work included, vs HF "
        "transformers eager and `torch.compile` of HF with a static cache; same checkpoint, "
        "float32, alternating runs, medians. Targets: ≥ 10× vs eager, ≥ 5× vs compile at "
        "batch 1.\n\n"
        + table(
            ["batch", "neffkit ms", "HF eager ms", "HF compile ms", "vs eager", "vs compile"], rows
        )
    )


def overhead(d: dict[str, Any]) -> str:
    rows = [
        [r["batch"], f"{r['step_us']:.1f}", f"{r['overhead_us']:.1f}", f"{r['share']:.1%}"]
        for r in d["rows"]
    ]
    return (
        "**Host overhead** (`bench/overhead.py`): decode-step wall time outside the graph call "
        "(scheduling, metadata, conversions, reading tokens). Target: ≤ 50 µs and ≤ 5%.\n\n"
        + table(["batch", "step µs", "outside the graph µs", "share"], rows)
    )


def roofline(d: dict[str, Any]) -> str:
    return (
        f"**Roofline on {cpu(d)}** (`bench/roofline.py`): batch-1 decode of a "
        f"{d['parameters'] / 1e6:.0f}M-parameter Llama (fp32, random weights) reads "
        f"{d['bytes_per_token'] / 1e6:.0f} MB per token; at that machine's measured read "
        f"bandwidth of {d['read_bandwidth_gb_s']:.1f} GB/s that bounds a token at "
        f"{d['bound_ms']:.2f} ms. neffkit takes {d['measured_ms']:.2f} ms: "
        f"**{d['fraction_of_roofline']:.0%} of the roofline** (target ≥ 85%)."
    )


def matrix(d: dict[str, Any]) -> str:
    rows = [[r["input"], f"{r['ttft_ms']:.2f}", f"{r['tpot_ms']:.3f}"] for r in d["rows"]]
    return (
        f"**TTFT / TPOT matrix** (`bench/matrix.py`): batch 1, output {d['output']}, "
        "ignore_eos, greedy, random prompts, demo model.\n\n"
        + table(["input tokens", "TTFT ms", "TPOT ms"], rows)
    )


def tp(d: dict[str, Any]) -> str:
    return (
        f"**Tensor parallelism on CPU** (`bench/tp.py`): tp=1 {d['tp1_ms_per_token']:.3f} ms/token,"
        f" tp=2 {d['tp2_ms_per_token']:.3f} ms/token; a gloo all-reduce costs "
        f"{d['all_reduce_us']:.0f} µs here and {d['all_reduces_per_step']} per step make "
        f"{d['collective_share_tp2']:.0%} of a tp=2 step: CPU TP is a correctness path."
    )


def moe(d: dict[str, Any]) -> str:
    before, after = d.get("before", {}), d["after"]
    then = (
        f" Before routed decode (every expert on every token): {before['e8_ms_per_step']:.2f} ms "
        f"and {before['e64_ms_per_step']:.2f} ms ({before['ratio_e64_to_e8']:.2f}×)."
        if before
        else ""
    )
    return (
        f"**MoE decode** (`bench/moe.py`, Mixtral shape, hidden 1024, 4 layers, top-2, batch 1): "
        f"a step with 8 experts {after['e8_ms_per_step']:.2f} ms, with 64 experts (0.4 B "
        f"parameters) {after['e64_ms_per_step']:.2f} ms ({after['ratio_e64_to_e8']:.2f}×): "
        f"a step reads the 2 routed experts, not all of them.{then}"
    )


def batch(d: dict[str, Any]) -> str:
    rows = []
    for label in ("inductor", "kernel"):
        f = d.get(label)
        if not f:
            continue
        for dtype in ("float32", "bfloat16"):
            rows.append(
                [
                    label,
                    dtype,
                    f"{f[f'{dtype}_b1_ms']:.1f}",
                    f"{f[f'{dtype}_b4_ms']:.1f}",
                    f"{f[f'{dtype}_b8_ms']:.1f}",
                    f"{f[f'{dtype}_b8_over_b1']:.2f}×",
                    f"{f[f'{dtype}_b8_tokens_per_s_over_b1']:.2f}×",
                ]
            )
    return (
        "**Decode batch scaling** (`bench/batch.py`, a 125M Llama: hidden 1024, 6 layers, vocab "
        f"32000; ms per step, {d.get('rounds', 3)} alternating rounds, both forms in the same "
        "run). Projection weights stored blocked [out/16, in, 16]. *inductor* "
        "(`compiler.cpu_kernel: off`): every decode bucket a register-blocked reduction that "
        "Inductor fuses (`models/projection.py`). *kernel* (the default): neffkit's C++ kernel "
        "(`neffkit/platform/csrc/blocked_rows.cpp`), R x U accumulators in registers fed by each "
        "weight vector once (bf16 widened in-register), weight lines prefetched ahead; bf16 rows "
        "on bf16 weights through AMX tiles where the CPU has them"
        + (
            f" ({d['compute']['bfloat16_rows']} here)"
            if "bfloat16_rows" in d.get("compute", {})
            else ""
        )
        + ".\n\n"
        + table(["", "dtype", "batch 1", "batch 4", "batch 8", "b8 / b1", "tokens/s b8 / b1"], rows)
        + _compute_floor(d)
    )


def _compute_floor(d: dict[str, Any]) -> str:
    c, k = d.get("compute"), d.get("kernel")
    if not c or not k:
        return ""
    parts = [
        f"{dtype} {c[f'{dtype}_b8_gmac_per_s']:.0f} GMAC/s, a batch-8 floor of "
        f"{c[f'{dtype}_b8_floor_ms']:.1f} ms = "
        f"{c[f'{dtype}_b8_floor_ms'] / k[f'{dtype}_b1_ms']:.2f}x the batch-1 step"
        for dtype in ("float32", "bfloat16")
    ]
    return (
        "\n\nCompute ceiling of the kernel on this machine (8 rows on an L2-resident weight, "
        f"all threads; {c['projection_parameters'] / 1e6:.0f}M projection parameters x 8 rows "
        f"per step): {'; '.join(parts)}. Where that floor is above 1.6x the batch-1 step, batch "
        "8 is bound by the CPU's multiply-adds, not by streaming the weights."
    )


def burst(d: dict[str, Any]) -> str:
    by = {(r["variant"], r["arrivals"], r["prompt_len"]): r for r in d["rows"]}
    rows = []
    for (variant, n, length), r in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if variant != "packed":
            continue
        one = by.get(("one_per_step", n, length))
        rows.append(
            [
                f"{n} × {length} tokens",
                f"{one['ttft_p50_ms']:.0f}" if one else "",
                f"{one['ttft_p99_ms']:.0f}" if one else "",
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
            ]
        )
    return (
        "**Time to first token under a burst** (`bench/burst.py`, the 125M Llama, float32, "
        f"engine-level, medians of {d['rounds']} alternating rounds): N prompts queued at the "
        "same instant; one prompt prefilled per step (`prefill_batch: [1]`) against packed "
        "prefill (`prefill_batch: [1, 8]`: one call, the prompts' tokens side by side). "
        "ms.\n\n"
        + table(
            ["arrivals", "one per step p50", "one per step p99", "packed p50", "packed p99"],
            rows,
        )
    )


def mla(d: dict[str, Any]) -> str:
    rows = [
        [
            r["context_tokens"],
            f"{r['absorbed_ms']:.1f}",
            f"{r['expanded_ms']:.1f}",
            f"{r['expanded_over_absorbed']:.1f}×",
        ]
        for r in d["rows"]
    ]
    m = d["model"]
    return (
        f"**MLA decode** (`bench/mla.py`: DeepSeek-V3 shape, hidden {m['hidden_size']}, "
        f"{m['num_attention_heads']} heads, kv_lora_rank {m['kv_lora_rank']}, "
        f"{m['num_hidden_layers']} layers, batch 1, context bucket {m['context_bucket']}): the "
        f"latent cache takes {d['latent_bytes_per_token']} bytes per token against "
        f"{d['per_head_kv_bytes_per_token']} for per-head K/V. A step attends over the whole "
        "context bucket (static shape), so the expanded form's cost, up-projecting every "
        "cached latent, does not fall with the prompt.\n\n"
        + table(
            ["prompt tokens", "absorbed ms/step", "expanded ms/step", "expanded / absorbed"], rows
        )
    )
