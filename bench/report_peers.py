"""The performance page's sections against other systems on the same CPU, each from its
bench/results/*.json: the ahead-of-time CPU peers (OpenVINO GenAI, ONNX Runtime GenAI) and
llama.cpp, with neffkit's speed relative to each. bench/report.py puts them in order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_format import PEER_COLUMNS, cpu, table  # noqa: E402


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
        f"**Against the ahead-of-time CPU peers on {cpu(d)}** (`bench/peers.py`, same 125M "
        f"checkpoint, same run, {d['rounds']} alternating rounds): batch 1 is the median decode "
        f"step; batch 8 is {d['prompts']} prompts × {d['new_tokens']} new tokens end to end "
        "(prefill included; "
        "OpenVINO through its ContinuousBatchingPipeline, neffkit with packed prefill, "
        "`prefill_batch: [1, 8]`). Greedy tokens against HF transformers "
        f"(fp32 reference; bf16 rounding flips some). Builds: {builds}."
        + (f" Not run: {notes}" if notes else "")
        + "\n\n"
        + table(["system", "batch 1 ms/token", "batch 8 tokens/s", "greedy = HF"], rows)
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
        f"**Against llama.cpp on {cpu(d)}** (`bench/llamacpp.py`, "
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
        + table(
            ["neffkit / llama.cpp weights", *PEER_COLUMNS],
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
            + table(
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


def vllm_cpu(d: dict[str, Any]) -> str:
    """bench/vllm_cpu.py: neffkit's server and vLLM's CPU server under `vllm bench serve`."""
    medians = d["medians"]
    rows = []
    for c in map(str, d["concurrency"]):
        row = [c]
        for name in ("neffkit", "vLLM CPU"):
            m = medians.get(name, {}).get(c)
            row += (
                [
                    f"{m['output_tokens_per_s']:.1f}",
                    f"{m['median_ttft_ms']:.0f}",
                    f"{m['median_tpot_ms']:.1f}",
                ]
                if m
                else ["—", "—", "—"]
            )
        rows.append(row)
    header = ["concurrency"] + [
        f"{name} {what}" for name in ("neffkit", "vLLM") for what in ("tok/s", "TTFT ms", "TPOT ms")
    ]
    refused = "".join(
        f" {name} could not run on this host: {(why.strip().splitlines() or [''])[-1]}."
        for name, why in d.get("refused", {}).items()
    )
    return (
        f"**Beside vLLM's CPU server** (`bench/vllm_cpu.py`: `vllm bench serve --backend openai "
        f"--dataset-name random --random-input-len {d['input_len']} --random-output-len "
        f"{d['output_len']} --ignore-eos --temperature 0` against each server, {d['model']} "
        f"{d['dtype']}, {d['rounds']} alternating rounds, medians; CPU flags "
        f"{', '.join(d['cpu_flags'])}).{refused}\n\n" + table(header, rows)
    )
