"""Summarise bench/results/*.json as tables; `--write-docs` puts them into docs/performance.md.

The performance page's figures sit between `<!-- bench:begin -->` and `<!-- bench:end -->` and
are generated here from the JSON the benchmark scripts wrote, never typed by hand, so they are the
last measured ones, with the machine they were measured on.

    python bench/report.py               # print the summary
    python bench/report.py --write-docs  # and rewrite the block in docs/performance.md
                                         # (--write-readme: the same, kept for old scripts)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PAGE = REPO / "docs" / "performance.md"  # the page whose marked block --write-docs rewrites
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _machine(d: dict[str, Any]) -> str:
    m = d.get("machine", {})
    return f"{m.get('cpu', '?')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}"


def _cpu(d: dict[str, Any]) -> str:
    m = d.get("machine", {})
    return f"{m.get('cpu', '?')}, {m.get('threads', '?')} threads"


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
        + _table(
            ["batch", "neffkit ms", "HF eager ms", "HF compile ms", "vs eager", "vs compile"], rows
        )
    )


def _bundle_name(path: str) -> str:
    """A repository-relative bundle path as written; an absolute one by its directory name."""
    return Path(path).name if Path(path).is_absolute() else path


def serve(d: dict[str, Any]) -> str:
    rows = []
    for lv in d["levels"]:
        engine = lv.get("engine_only_tokens_per_s")
        rows.append(
            [
                lv["concurrency"],
                f"{lv['output_tokens_per_s']:.0f}",
                f"{lv['throughput_vs_first']:.2f}×",
                f"{engine:.0f}" if engine else "-",
                f"{lv['output_tokens_per_s'] / engine:.0%}" if engine else "-",
                f"{lv['ttft']['median_ms']:.1f}",
                f"{lv['tpot']['median_ms']:.2f}",
                f"{lv['itl']['p99_ms']:.2f}",
            ]
        )
    return (
        f"**Serving** (`bench/serve.py`, bundle `{_bundle_name(d['bundle'])}`): concurrent "
        f"streaming clients against `neffkit run` ({d['input_len']}-token prompts, "
        f"{d['output_len']} output "
        "tokens, ignore_eos), vLLM "
        "bench-serve definitions; *engine alone* is `LLM.generate` on the same work with no "
        "HTTP, in the same run.\n\n"
        + _table(
            [
                "streams",
                "output tok/s",
                "vs 1 stream",
                "engine alone tok/s",
                "server/engine",
                "TTFT median ms",
                "TPOT median ms",
                "ITL p99 ms",
            ],
            rows,
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
        + _table(["batch", "step µs", "outside the graph µs", "share"], rows)
    )


def startup(d: dict[str, Any]) -> str:
    med = d["median_seconds"]
    rows = [
        ["neffkit bundle", f"{med['neffkit']:.2f}", "1.0×"],
        ["HF transformers eager", f"{med['hf_eager']:.2f}", f"{d['hf_eager_vs_neffkit']:.1f}×"],
        ["HF + torch.compile", f"{med['hf_compile']:.2f}", f"{d['hf_compile_vs_neffkit']:.1f}×"],
    ]
    split = (
        f" Of that, `import torch` takes {d['neffkit_import_torch_s']:.2f} s and everything "
        f"else (neffkit's imports, bundle checks, mapping the weights, loading the graphs, the "
        f"first step) {d['neffkit_beyond_torch_and_weights_s']:.3f} s (target ≤ 0.1 s)"
        + (
            f", of which {d['interpreter_s']:.3f} s is the bare interpreter (`python -c` of "
            f"this venv): neffkit's own share is "
            f"{d['neffkit_beyond_interpreter_torch_and_weights_s']:.3f} s."
            if "interpreter_s" in d
            else "."
        )
        if "neffkit_import_torch_s" in d
        else ""
    )
    return (
        "**Startup** (`bench/startup.py`): fresh process → first token. neffkit spends "
        f"{d['neffkit_beyond_weights_s']:.2f} s beyond reading its weights "
        f"({d['neffkit_weights_s']:.3f} s).{split} Targets: ≤ 1 s beyond the weights, ≥ 20× "
        "faster than the torch.compile path.\n\n" + _table(["path", "seconds", "vs neffkit"], rows)
    )


def roofline(d: dict[str, Any]) -> str:
    return (
        f"**Roofline on {_cpu(d)}** (`bench/roofline.py`): batch-1 decode of a "
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
        + _table(["input tokens", "TTFT ms", "TPOT ms"], rows)
    )


def build(d: dict[str, Any]) -> str:
    return (
        f"**Build on {_cpu(d)}** (`bench/build.py`; cold: every cache empty, Inductor's and "
        f"the kernel autotuning's too): the demo manifest's {d['graphs']} graphs cold in "
        f"{d['cold_jobs1_s']:.1f} s with `-j 1` and {d['cold_jobs2_s']:.1f} s with `-j 2` "
        f"({d['speedup_jobs2']:.2f}×); a warm rebuild takes {d['warm_rebuild_s']:.1f} s "
        f"({d['warm_fraction_of_cold_jobs2']:.1%} of cold, {d['warm_compiled']} compiled"
        + (f", {d['warm_traced']} traced" if "warm_traced" in d else "")
        + ")."
        + (
            f" Two CI-matrix shards (`--shard k/2 -j 1`, run at once into one cache) take "
            f"{d['shards_wall_s']:.1f} s, and the assembling build {d['assembly_s']:.1f} s "
            f"({d['assembly_compiled']} compiled): {d['shards_fraction_of_cold_jobs2']:.2f}× "
            "the local `-j 2` build."
            if "shards_wall_s" in d
            else ""
        )
        + (
            f" Through a two-node Ray cluster on that machine (one CPU a node; started in "
            f"{d['cluster_start_s']:.1f} s, not counted) the cold build takes "
            f"{d['cluster_cold_s']:.1f} s, {d['cluster_over_cold_jobs2']:.2f}× the local pool "
            "(one machine has no more cores to offer: what this shows is that Ray's overhead is "
            "small against compiles of tens of seconds)."
            if "cluster_cold_s" in d
            else ""
        )
    )


def build_large(d: dict[str, Any]) -> str:
    mb = 2**20
    return (
        f"**Build at scale** (`bench/build.py --large`, {d['model']}): a cold cpu build takes "
        f"{d['cpu_cold_build_s']:.0f} s with a main-process peak RSS of "
        f"{d['cpu_main_peak_rss_mb']:.0f} MB, the largest tensor "
        f"({d['largest_tensor_bytes'] / mb:.0f} MB) plus "
        f"{d['main_peak_minus_largest_tensor_mb']:.0f} MB (weights are streamed a tensor at a "
        "time; compile workers peak at "
        f"{d['cpu_workers_peak_rss_mb']:.0f} MB). `build --verify` on it: "
        f"{'ok' if d['verify_ok'] else 'FAILED'} for every graph. Lowered at tp=8 (neuron, "
        f"`--lower-only`): the largest rank shard is {max(d['tp8_shard_bytes']) / mb:.0f} MB, "
        f"{d['tp8_largest_shard_over_total_per_rank']:.2f}× total/8 (vocab-parallel embedding "
        "and LM head)."
    )


def peers(d: dict[str, Any]) -> str:
    names = {
        "neffkit_fp32": "neffkit fp32",
        "neffkit_bf16": "neffkit bf16",
        "openvino_fp32": "OpenVINO GenAI f32",
        "openvino_bf16": "OpenVINO GenAI bf16",
        "ort_genai_fp32": "ONNX Runtime GenAI fp32",
        "ort_genai_bf16": "ONNX Runtime GenAI bf16",
        "openvino": "OpenVINO GenAI",
        "neffkit_float32": "neffkit fp32",
        "neffkit_bfloat16": "neffkit bf16",
    }
    rows = [
        [
            names.get(k, k),
            f"{r['b1_token_ms']:.1f}",
            f"{r['b8_tokens_per_s']:.0f}",
            "yes" if r["greedy_equals_hf"] else f"no ({r['greedy_agreement']:.0%} of tokens)",
        ]
        for k, r in d["systems"].items()
    ]
    builds = ", ".join(f"{names.get(k, k)} {v:.0f} s" for k, v in d["build_s"].items())
    notes = " ".join(d.get("notes", []))
    return (
        f"**Against the ahead-of-time CPU peers on {_cpu(d)}** (`bench/peers.py`, same 125M "
        f"checkpoint, same run, {d['rounds']} alternating rounds): batch 1 is the median decode "
        f"step; batch 8 is {d['prompts']} prompts × {d['new_tokens']} new tokens end to end "
        "(prefill included; "
        "OpenVINO through its ContinuousBatchingPipeline, neffkit with packed prefill, "
        "`prefill_batch: [1, 8]`). Greedy tokens against HF transformers "
        f"(fp32 reference; bf16 rounding flips some). Builds: {builds}."
        + (f" Not run: {notes}" if notes else "")
        + "\n\n"
        + _table(["system", "batch 1 ms/token", "batch 8 tokens/s", "greedy = HF"], rows)
        + "\n\n"
        + _peer_ratios(d["systems"])
    )


def _peer_ratios(systems: dict[str, Any]) -> str:
    """Where neffkit is ahead and where it is not, as ratios (> 1: neffkit faster)."""
    parts = []
    for precision in ("fp32", "bf16"):
        ours = systems.get(f"neffkit_{precision}", {})
        for peer, label in (("openvino", "OpenVINO GenAI"), ("ort_genai", "ONNX Runtime GenAI")):
            if f"b1_speedup_vs_{peer}" in ours:
                parts.append(
                    f"{precision} vs {label}: batch 1 {ours[f'b1_speedup_vs_{peer}']:.2f}×, "
                    f"batch 8 {ours[f'b8_speedup_vs_{peer}']:.2f}×"
                )
    behind = any(v < 1 for r in systems.values() for k, v in r.items() if "speedup" in k)
    verdict = " Below 1×, neffkit was the slower of the two in this run." if behind else ""
    return (
        "neffkit's speed relative to each peer (> 1× is faster): "
        + "; ".join(parts)
        + "."
        + verdict
    )


def llamacpp(d: dict[str, Any]) -> str:
    names = {"float32": "fp32 / f32", "bfloat16": "bf16 / bf16", "fp8": "fp8 (128x128) / Q8_0"}

    def cell(value: float | None, form: str, unit: str = "") -> str:  # None: llama.cpp crashed
        return "crashed" if value is None else format(value, form) + unit

    rows = [
        [
            names.get(k, k),
            f"{r['neffkit_b1_ms']:.2f}",
            cell(r["llamacpp_b1_ms"], ".2f"),
            cell(r["b1_speed_relative"], ".2f", "×"),
            f"{r['neffkit_b8_tokens_per_s']:.0f}",
            cell(r["llamacpp_b8_tokens_per_s"], ".0f"),
            cell(r["b8_speed_relative"], ".2f", "×"),
        ]
        for k, r in d["rows"].items()
    ]
    text = (
        f"**Against llama.cpp on {_cpu(d)}** (`bench/llamacpp.py`, "
        f"{d['model'].split(' (')[0]}, the same weights converted by llama.cpp's own "
        f"converter; {d['llama_cpp']}; {d['threads']} threads each, {d['rounds']} alternating "
        "rounds, medians). Batch 1: ms per token (`llama-bench -p 0 -n 64`; neffkit's median "
        "decode step). Batch 8: "
        f"{d['b8_work']}, end to end, output tokens/s (`llama-batched-bench`; neffkit "
        "`LLM.generate` with packed prefill). neffkit's fp8 bundle has block-fp8 projections "
        "and LM head (`lm_head: {dtype: float8_e4m3fn}`), as Q8_0 quantizes the output tensor "
        "too. Relative: neffkit's speed over llama.cpp's (> 1× is faster)."
        + "".join(
            f" llama.cpp {k}: {v} (so no figure)."
            for k, v in d.get("llamacpp_failures", {}).items()
        )
        + "\n\n"
        + _table(
            [
                "neffkit / llama.cpp weights",
                "b1 ms neffkit",
                "b1 ms llama.cpp",
                "b1 relative",
                "b8 tok/s neffkit",
                "b8 tok/s llama.cpp",
                "b8 relative",
            ],
            rows,
        )
    )
    if "serving" in d:
        srows = [
            [
                names.get(k, k),
                *(f"{v[s][f'streams_{c}']:.0f}" for c in (1, 8) for s in ("neffkit", "llamacpp")),
            ]
            for k, v in d["serving"].items()
        ]
        text += (
            "\n\nServing, output tokens/s (`neffkit run` against `llama-server -np 8`, "
            "bench/serve.py's client: 32-token prompts, 64 tokens out, greedy):\n\n"
            + _table(
                [
                    "weights",
                    "1 stream neffkit",
                    "1 stream llama.cpp",
                    "8 streams neffkit",
                    "8 streams llama.cpp",
                ],
                srows,
            )
        )
    greedy = d.get("greedy_vs_hf", {})
    if greedy:
        labels = {"llamacpp": "llama.cpp", "float32": "fp32", "bfloat16": "bf16", "q8_0": "Q8_0"}

        def label(key: str) -> str:
            system, kind = key.split("_", 1)
            return f"{labels.get(system, system)} {labels.get(kind, kind)}"

        parts = [f"{label(k)} {g['identical']}/{g['prompts']}" for k, g in greedy.items()]
        text += (
            "\n\nGreedy tokens against HF transformers (float32) on chat prompts, up to EOS, "
            "prompts identical: " + ", ".join(parts) + "."
        )
    return text


def fp8(d: dict[str, Any]) -> str:
    if "rows" not in d:
        return _fp8_kl(d["kl"]) if "kl" in d else ""
    rows = [
        [
            k,
            f"{r['weight_bytes'] / 1e6:.0f} MB",
            f"{r['bytes_vs_fp32']:.2f}×",
            f"{r['b1_step_ms']:.1f}",
            f"{r['step_vs_fp32']:.2f}×",
            f"{r['greedy_agreement_with_fp32']:.0%}",
        ]
        for k, r in d["rows"].items()
    ]
    return (
        "**fp8 weights** (`bench/fp8.py`, the same 125M Llama quantized to block fp8 128×128; "
        "norms, embedding and LM head in bf16): bytes a rank streams and the batch-1 step.\n\n"
        + _table(
            ["weights", "shard", "vs fp32", "b1 step ms", "vs fp32", "greedy tokens = fp32"], rows
        )
        + ("\n\n" + _fp8_kl(d["kl"]) if "kl" in d else "")
    )


def _unsigned(value: float) -> float:
    """A divergence that rounding left a hair below zero reads as 0."""
    return max(value, 0.0) + 0.0


def _fp8_kl(kl: dict[str, Any]) -> str:
    rows = [
        [
            k,
            f"{_unsigned(r['mean_kl']):.5f}",
            f"{_unsigned(r['kl_vs_bf16_weights']):.2f}×",
            f"{r['top1_agreement']:.1%}",
        ]
        for k, r in kl["rows"].items()
    ]
    return (
        f"**What quantization costs on a real model** (`bench/fp8.py`, {kl['model']}, "
        f"{kl['tokens']} tokens of `{kl['text']}`): mean next-token KL divergence from "
        f"{kl['reference']}, neffkit's model code run eagerly (every position reads the cache "
        "back as a decode step does); fp8 weights are block 128x128 with the rest float32; "
        "fp8 KV uses float32 weights, and by default stores keys centered, weighted and rotated "
        "(`kv_cache.rotate_keys`; *keys as they are*: `rotate_keys: false`).\n\n"
        + _table(["variant", "mean KL", "vs bf16 weights", "top-1 = reference"], rows)
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
        + _table(
            ["", "dtype", "batch 1", "batch 4", "batch 8", "b8 / b1", "tokens/s b8 / b1"], rows
        )
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
        + _table(
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
        + _table(
            ["prompt tokens", "absorbed ms/step", "expanded ms/step", "expanded / absorbed"], rows
        )
    )


def serve_prefix(d: dict[str, Any]) -> str:
    rows = []
    for on, off in zip(d["prefix_caching_on"], d["prefix_caching_off"], strict=True):
        rows.append(
            [
                on["concurrency"],
                f"{on['output_tokens_per_s']:.0f}",
                f"{off['output_tokens_per_s']:.0f}",
                f"{on['ttft']['median_ms']:.1f}",
                f"{off['ttft']['median_ms']:.1f}",
            ]
        )
    return (
        f"**Serving a shared prefix** (`bench/serve.py --shared-prefix {d['shared_prefix']}`, "
        f"bundle `{_bundle_name(d['bundle'])}`): each prompt one of {d['prefixes']} shared "
        f"{d['shared_prefix']}-token prefixes and {d['input_len']} tokens of its own, "
        f"{d['output_len']} output tokens; the same requests against a server with prefix "
        "caching and one with `--no-prefix-caching`, in one run.\n\n"
        + _table(
            [
                "streams",
                "tok/s cached",
                "tok/s uncached",
                "TTFT median ms cached",
                "TTFT median ms uncached",
            ],
            rows,
        )
    )


def prefix_cache(d: dict[str, Any]) -> str:
    return (
        f"**Prefix cache hit** (`bench/prefix_cache.py`, `{_bundle_name(d['bundle'])}`): a "
        f"{d['question_tokens']}-token question after a {d['system_prompt_tokens']}-token "
        f"system prompt, time to first token through the engine, median of {d['pairs']} "
        f"alternating pairs: {d['ttft_cold_ms']:.0f} ms cold, {d['ttft_hit_ms']:.0f} ms with "
        f"the system prompt cached ({d['speedup']:.1f}x); the hits' tokens equal uncached "
        f"runs': {'yes' if d['hit_tokens_equal_uncached'] else 'no'}."
    )


def speculation(d: dict[str, Any]) -> str:
    def group(name: str) -> str:
        g = d[name]
        lengths = ", ".join(f"{a:.2f}" for a in g["mean_acceptance_length"])
        return (
            f"{g['speedup_median']:.2f}x decode tokens/s (median of {g['prompts']} prompts; "
            f"mean acceptance lengths {lengths})"
        )

    draft = d.get("draft")
    title = "draft-model speculation" if draft else "n-gram speculation"
    flag = " --draft" if draft else ""
    proposing = (
        f" The draft ({draft}) proposes K tokens in {d['draft_step_ms']:.1f} ms (one catch-up "
        "call and K - 1 decode steps), counted in decode time."
        if draft
        else ""
    )
    return (
        f"**{title}** (`bench/speculation.py{flag}`, `{_bundle_name(d['bundle'])}`, batch 1, "
        f"K = {d['num_tokens']}): a verify step costs {d['verify_step_ms']:.1f} ms against "
        f"{d['decode_step_ms']:.1f} ms for a decode step ({d['verify_over_decode']:.2f}x)."
        f"{proposing} Prompts that quote their input: {group('quoting')}; open questions: "
        f"{group('open')}. Outputs with and without speculation are equal."
    )


def structured(d: dict[str, Any]) -> str:
    rows = [
        [
            r["batch"],
            *(f"{v:.2f}" for v in r["ms_per_step"].values()),
            f"{r['unconstrained_rows_with_inputs_vs_plain']:.3f}x",
            f"{r['json_schema_rows_vs_unconstrained']:.3f}x",
        ]
        for r in d["rows"]
    ]
    header = [
        "batch",
        "plain graphs ms",
        "with logit inputs ms",
        "JSON-schema rows ms",
        "inputs / plain",
        "schema / unconstrained",
    ]
    return (
        f"**Structured outputs** (`bench/structured.py`, {d['model']}): what the token bitmask, "
        "penalty and bias inputs cost rows that use none of them, and what following a JSON "
        f"schema adds (llguidance's mask on the host, applied in the graph). {d['method']}.\n\n"
        + _table(header, rows)
    )


def threads(d: dict[str, Any]) -> str:
    rows = [
        [r["setting"], f"{r['quiet_tok_s']:.0f}", f"{r['contended_tok_s']:.0f}", f"{r['kept']:.0%}"]
        for r in d["rows"]
    ]
    header = ["engine setting", "quiet tok/s", "beside a busy process tok/s", "kept"]
    return (
        f"**A shared host** (`bench/threads.py`, {d['model']}): {d['method']}. Under "
        f"`taskset -c 0` the engine takes {d['taskset_c0_engine_threads']} thread(s) by "
        "default.\n\n" + _table(header, rows)
    )


def bf16_agreement(d: dict[str, Any]) -> str:
    rows = []
    for m in d["models"]:
        cells = [m["model"]]
        for key in ("neffkit_bf16_vs_hf_bf16", "neffkit_bf16_vs_hf_fp32", "hf_bf16_vs_hf_fp32"):
            a = m[key]
            cells.append(
                f"{a['mean_agreement']:.0%} ({a['prompts_equal_to_the_end']}/{m['prompts']})"
            )
        rows.append(cells)
    return (
        "**bf16 agreement** (`bench/bf16_agreement.py`): greedy tokens of a bf16 bundle against "
        "HF transformers in bf16 and in float32, 5 prompts x 64 tokens; each cell the mean "
        "common prefix over 64 tokens (prompts equal to the end).\n\n"
        + _table(
            ["model", "neffkit bf16 vs HF bf16", "neffkit bf16 vs HF fp32", "HF bf16 vs HF fp32"],
            rows,
        )
    )


def lm_eval(d: dict[str, Any]) -> str:
    return (
        f"**lm-eval through the server** (`bench/lm_eval.py`, lm-eval {d['lm_eval_version']}): "
        f"{d.get('model', 'demo-llama')}, `{d['task']}`, {d['documents']} documents, "
        f"acc {d['acc_through_server']:.2f} through "
        f"`neffkit run` and {d['acc_hf_oracle']:.2f} from HF's forward on the same token ids; "
        f"largest loglikelihood difference {d['max_loglikelihood_difference']:.1e}."
    )


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("decode", decode),
    ("serve", serve),
    ("serve_125m", serve),
    ("serve_125m_one_per_step", serve),
    ("serve_125m_packed", serve),
    ("burst", burst),
    ("overhead", overhead),
    ("startup", startup),
    ("roofline", roofline),
    ("roofline_intel", roofline),
    ("matrix", matrix),
    ("build", build),
    ("build_large", build_large),
    ("peers", peers),
    ("peers_intel", peers),
    ("llamacpp", llamacpp),
    ("llamacpp_intel", llamacpp),
    ("fp8", fp8),
    ("tp", tp),
    ("batch", batch),
    ("moe", moe),
    ("mla", mla),
    ("serve_prefix", serve_prefix),
    ("prefix_cache", prefix_cache),
    ("speculation", speculation),
    ("speculation_draft", speculation),
    ("structured", structured),
    ("threads", threads),
    ("bf16_agreement", bf16_agreement),
    ("lm_eval_smollm2", lm_eval),
    ("lm_eval", lm_eval),
]


def render(page_dir: Path = PAGE.parent) -> str:
    """The block's Markdown; image links are relative to `page_dir`, the page's folder."""
    parts, machines = [], set()
    for name, fn in SECTIONS:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        machines.add(_machine(data))
        parts.append(fn(data))
        if (RESULTS / f"{name}.png").exists():  # written by bench/plots.py from the same JSON
            image = Path(os.path.relpath(RESULTS / f"{name}.png", page_dir)).as_posix()
            parts.append(f"![{name}]({image})")
    head = (
        "Generated by `python bench/report.py --write-docs` from `bench/results/*.json` "
        f"(`make bench` reruns everything). Measured on: {'; '.join(sorted(machines))}."
    )
    return "\n\n".join([head, *parts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--write-docs",
        "--write-readme",  # the old name, when the block lived in the README: same effect
        dest="write_docs",
        action="store_true",
        help=f"rewrite the block between the markers in {PAGE.relative_to(REPO)}",
    )
    args = ap.parse_args()
    if args.write_docs:
        plots.write_all()
    text = render()
    print(text)
    if args.write_docs:
        content = PAGE.read_text()
        if BEGIN not in content or END not in content:
            sys.exit(f"{PAGE.relative_to(REPO)} has no {BEGIN} … {END} markers")
        before, rest = content.split(BEGIN, 1)
        _, after = rest.split(END, 1)
        PAGE.write_text(f"{before}{BEGIN}\n{text}\n{END}{after}")


if __name__ == "__main__":
    main()
