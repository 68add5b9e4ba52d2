"""PNG figures from bench/results/*.json, where a picture says more than the table.

decode.png: per-step latency against batch for neffkit and both HF paths; matrix.png: TTFT and
TPOT against input length; serve.png: output tokens/s against concurrent streams, server and
engine alone. Needs matplotlib (`pip install -e '.[bench]'`); `bench/report.py` calls `write_all`.

    python bench/plots.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _save(fig: Any, name: str) -> Path:
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def decode_plot(plt: Any, d: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    batches = [r["batch"] for r in d["rows"]]
    paths = (("neffkit", "neffkit"), ("hf_eager", "HF eager"), ("hf_compile", "HF compile"))
    for key, label in paths:
        ax.plot(batches, [r["ms_per_step"][key] for r in d["rows"]], marker="o", label=label)
    ax.set(xlabel="batch (sequences per step)", ylabel="ms per decode step", xticks=batches)
    ax.set_title("Decode latency, demo model (lower is better)")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


def matrix_plot(plt: Any, d: dict[str, Any]) -> Any:
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(8, 3.4))
    inputs = [r["input"] for r in d["rows"]]
    ttft.plot(inputs, [r["ttft_ms"] for r in d["rows"]], marker="o")
    ttft.set(xlabel="input tokens", ylabel="ms", title="time to first token", xticks=inputs)
    tpot.plot(inputs, [r["tpot_ms"] for r in d["rows"]], marker="o", color="tab:orange")
    tpot.set(xlabel="input tokens", ylabel="ms", title="time per output token", xticks=inputs)
    for ax in (ttft, tpot):
        ax.set_ylim(bottom=0)
    return fig


def serve_plot(plt: Any, d: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    levels = d["levels"]
    streams = [lv["concurrency"] for lv in levels]
    ax.plot(streams, [lv["output_tokens_per_s"] for lv in levels], marker="o", label="server")
    engine = [lv.get("engine_only_tokens_per_s") for lv in levels]
    if all(engine):
        ax.plot(streams, engine, marker="s", linestyle="--", label="engine alone")
    ax.set(xlabel="concurrent streams", ylabel="output tokens / s", xticks=streams)
    ax.set_title("Serving throughput, demo model (higher is better)")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


FIGURES = (("decode", decode_plot), ("matrix", matrix_plot), ("serve", serve_plot))


def write_all() -> list[Path]:
    """Write every figure whose results exist; none (and no error) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for name, draw in FIGURES:
        data = _load(name)
        if data is not None:
            fig = draw(plt, data)
            written.append(_save(fig, name))
            plt.close(fig)
    return written


if __name__ == "__main__":
    for path in write_all():
        print(f"wrote {path}")
