"""The performance page's sections on precision and accuracy, each from its
bench/results/*.json: fp8 weights (what a rank streams, the step, greedy agreement, and the KL
divergence quantization costs), bf16 agreement with HF transformers, and lm-eval through the
server. bench/report.py puts them in order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_format import table  # noqa: E402


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
        + table(
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
        + table(["variant", "mean KL", "vs bf16 weights", "top-1 = reference"], rows)
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
        + table(
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
