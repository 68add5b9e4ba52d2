"""The performance page's section per CPU class (bench/classes.py's results): neffkit against
llama.cpp on the same weights and GGUF files, batch 1 and batch 8, with the batch-1 bound."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_format import PEER_COLUMNS, table  # noqa: E402

NAMES = {
    "float32": "SmolLM2 fp32 / f32 GGUF",
    "bfloat16": "SmolLM2 bf16 / bf16 GGUF",
    "q8_0": "SmolLM2 Q8_0 GGUF (both)",
    "q4_1": "SmolLM2 Q4_1 GGUF (both)",
    "q8_0-a8": "SmolLM2 Q8_0 GGUF, int8 activations (both)",
    "q4_1-a8": "SmolLM2 Q4_1 GGUF, int8 activations (both)",
    "gemma3-q4_k_m": "Gemma 3 270M Q4_K_M GGUF (both)",
    "gemma3-q4_k_m-a8": "Gemma 3 270M Q4_K_M GGUF, int8 activations (both)",
    "int8": "SmolLM2 manifest int8",
    "int4": "SmolLM2 manifest int4 g32",
    "w8a8": "SmolLM2 W8A8 (compressed-tensors)",
}


def _cell(value: float | None, form: str, unit: str = "") -> str:
    return "—" if value is None else format(value, form) + unit


def _row(name: str, r: dict[str, Any]) -> list[str]:
    return [
        NAMES.get(name, name),
        _cell(r["neffkit_b1_ms"], ".2f"),
        _cell(r["llamacpp_b1_ms"], ".2f"),
        _cell(r["b1_speed_relative"], ".2f", "×"),
        _cell(r["neffkit_b8_tokens_per_s"], ".0f"),
        _cell(r["llamacpp_b8_tokens_per_s"], ".0f"),
        _cell(r["b8_speed_relative"], ".2f", "×"),
        _cell(r["neffkit_b8_step_vs_b1"], ".2f", "×"),
        _cell(r["b1_bandwidth_fraction"], ".0%"),
    ]


def classes(d: dict[str, Any]) -> str:
    h = d["host"]
    emulated = (
        f" The {h['measured_class']} class on a {h['host_class']} host: neffkit built with "
        "`NEFFKIT_CPU_ISA` and run with torch and oneDNN held to that class, llama.cpp built "
        "for it (`bench/llamacpp_build.py`); the instructions are the class's, the cores and "
        "memory this host's."
        if h["emulated"]
        else ""
    )
    text = (
        f"**{h['measured_class']} class: {h['cpu']}** (`bench/classes.py --cpu-class "
        f"{'native' if not h['emulated'] else h['measured_class']}`; {d['threads']} threads "
        f"each, {d['rounds']} alternating rounds, medians; read bandwidth "
        f"{d['read_bandwidth_gb_s']} GB/s by `torch.sum`).{emulated} Batch 1: ms per token "
        f"(llama-bench tg64; neffkit's median decode step). Batch 8: {d['b8_work']}, end to "
        "end, output tokens/s (llama-batched-bench; `LLM.generate`). Relative: neffkit's "
        "speed over llama.cpp's (> 1× is faster). b8 step / b1: the batch-8 step's cost over "
        "the batch-1 step's. Bound: weight bytes a step streams over the read bandwidth, as a "
        "share of neffkit's batch-1 step."
        + (
            f" Rows {', '.join(d['merged_rows'])}: from the run before (`--merge`)."
            if d.get("merged_rows")
            else ""
        )
        + "".join(
            f" llama.cpp {k}: {v} (so no figure)."
            for k, v in d.get("llamacpp_failures", {}).items()
        )
    )
    header = ["weights", *PEER_COLUMNS, "b8 step / b1", "b1 of bound"]
    rows = [_row(name, r) for name, r in d["rows"].items()]
    return text + "\n\n" + table(header, rows)
