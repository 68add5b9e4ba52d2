"""The performance page's sections on the time before a first token, each from its
bench/results/*.json: building a bundle (cold, warm, in CI shards, through a Ray cluster, and a
large model at scale) and starting one in a fresh process. bench/report.py puts them in order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_format import cpu, table  # noqa: E402


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
        "faster than the torch.compile path.\n\n" + table(["path", "seconds", "vs neffkit"], rows)
    )


def build(d: dict[str, Any]) -> str:
    return (
        f"**Build on {cpu(d)}** (`bench/build.py`; cold: every cache empty, Inductor's and "
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
