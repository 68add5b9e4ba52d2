"""neffkit's W8A8 kernel (neffkit::int8_rows, csrc/int8_rows.cpp) against the graph's form
(`intquant.project_w8a8` compiled by Inductor) on SmolLM2-135M's shapes, call by call.

SmolLM2's projections as a layer calls them (q/k/v in one call: 960 outputs; o; gate/up: 3072
outputs; down: 576 x 1536) and its 49152 x 576 head, int8 codes with a scale per output, random
values; 30 layers of weights, each its own tensor, so that a round streams them from memory as a
decode step does (the head: one). For 1, 8 and 64 rows (decode, a batch, a prefill chunk) each
round times every variant once, alternating: Inductor's compiled form (weights as inputs, as
AOTInductor graphs take them), and the kernel on each path this library and CPU have (AMX tiles
from 4 rows on, AVX-512 VNNI, AVX2 VPMADDUBSW). Medians over rounds: ms a call, and GB/s of
weight bytes streamed. The AVX2 class (`$NEFFKIT_CPU_ISA=avx2`: the library and Inductor's code
built for -march=x86-64-v3) runs in a subprocess. Writes bench/results/int8_rows.json.

    .venv/bin/python bench/int8_rows.py [--rounds 7] [--rows 1,8,64] [--threads 2] [--no-avx2]
    .venv/bin/python bench/int8_rows.py --threads 1 --cpu-time   # on a shared, busy host
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, parse_args, write_result  # noqa: E402

HIDDEN, MLP, VOCAB, LAYERS = 576, 1536, 49152, 30
# one call each: the weights reading one input, and their input width
CALLS = {
    "qkv": ((HIDDEN, 192, 192), HIDDEN),
    "o": ((HIDDEN,), HIDDEN),
    "gate_up": ((MLP, MLP), HIDDEN),
    "down": ((HIDDEN,), MLP),
    "head": ((VOCAB,), HIDDEN),
}
PATHS = {"amx": 2, "vnni": 1, "avx2": 0}

Parts = list[dict[str, torch.Tensor]]


def make_layers(outputs: tuple[int, ...], k: int, copies: int) -> list[Parts]:
    from neffkit.kernels.intquant import SCALE

    return [
        [
            {"": torch.randint(0, 256, (n, k), dtype=torch.uint8), SCALE: torch.rand(n, 1) / 64}
            for n in outputs
        ]
        for _ in range(copies)
    ]


def graph_form() -> Callable[..., Any]:
    """project_w8a8 of each weight, compiled by Inductor for this process's CPU class."""
    from neffkit.compile.backends.inductor import class_options
    from neffkit.kernels.intquant import SCALE, Int8Activations, QuantScheme, project_w8a8

    scheme = QuantScheme("sym", 8, 0, zero=128, activations="int8-token")

    def forward(x: torch.Tensor, codes: list[torch.Tensor], scales: list[torch.Tensor]) -> Any:
        return [
            project_w8a8(x, Int8Activations({"": c, SCALE: s}, scheme))
            for c, s in zip(codes, scales, strict=True)
        ]

    torch._dynamo.reset()  # each call shape its own graph (not a recompile of the last one)
    return torch.compile(forward, dynamic=False, options=class_options())


def kernel_paths() -> list[str]:
    """The paths this library and CPU have (int8_rows_path grants at most what is asked)."""
    return [name for name, p in PATHS.items() if torch.ops.neffkit.int8_rows_path(p) == p]


def time_call(name: str, rows: int, rounds: int, clock: Callable[[], float]) -> dict[str, Any]:
    outputs, k = CALLS[name]
    layers = make_layers(outputs, k, 1 if name == "head" else LAYERS)
    args = [([w[""] for w in parts], [w[".qscale"] for w in parts]) for parts in layers]
    x = torch.randn(rows, k)
    compiled = graph_form()
    variants: dict[str, Callable[[], Any]] = {
        "inductor": lambda: [compiled(x, c, s) for c, s in args],
    }
    for path in kernel_paths():

        def run(p: int = PATHS[path]) -> None:
            torch.ops.neffkit.int8_rows_path(p)
            for c, s in args:
                torch.ops.neffkit.int8_rows(x, c, s)

        variants[path] = run
    for fn in variants.values():  # compile, warm up
        fn()
        fn()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v, fn in variants.items():
            t0 = clock()
            fn()
            times[v].append((clock() - t0) / len(args))
    torch.ops.neffkit.int8_rows_path(-1)
    weight_bytes = sum(outputs) * k
    return {
        v: {"ms": round(1e3 * median(t), 4), "GBps": round(weight_bytes / median(t) / 1e9, 2)}
        for v, t in times.items()
    }


def load_library(library: str | None) -> str:
    """The build's library for this process's class; where another source does not compile for
    the class yet, int8_rows.cpp alone with the same command (what is timed here is its op)."""
    from neffkit.platform import cpu_kernels

    if library:
        cpu_kernels.load_library(library)
        return library
    try:
        path = cpu_kernels.build_library()
    except cpu_kernels.KernelBuildError as exc:
        print(f"the class's library does not compile ({str(exc)[-300:]}); int8_rows.cpp alone")
        cpu_kernels.SOURCES = (cpu_kernels.CSRC / "int8_rows.cpp",)
        path = cpu_kernels.build_library()  # another key: its own command
    cpu_kernels.load_library(path)
    return str(path)


def run_class(args: argparse.Namespace) -> dict[str, Any]:
    """Every call and row count in this process (its CPU class: $NEFFKIT_CPU_ISA)."""
    from neffkit.platform import isa

    library = load_library(args.library)
    rows = [int(r) for r in args.rows.split(",")]
    # thread CPU time: one thread only, where a shared host's other work would show in wall time
    clock = time.thread_time if args.cpu_time else time.perf_counter
    out: dict[str, Any] = {"class": isa.chosen_class(), "library": Path(library).name}
    out |= {"paths": kernel_paths(), "calls": {}}
    for name in CALLS:
        for r in rows:
            result = time_call(name, r, args.rounds, clock)
            out["calls"][f"{name}/{r}"] = result
            cells = [f"{v} {t['ms']:.3f} ms {t['GBps']:5.1f} GB/s" for v, t in result.items()]
            print(f"{out['class']:6} {name:8} {r:3} rows  {'  '.join(cells)}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time (--threads 1)")
    parser.add_argument("--no-avx2", action="store_true", help="skip the AVX2 class")
    parser.add_argument("--library", help="a library to load instead of the build's")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(parser)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time times the calling thread: use --threads 1")
    torch.set_num_threads(args.threads)
    result = run_class(args)
    if args.child:
        print("RESULT " + json.dumps(result))
        return
    classes = {"native": result}
    if not args.no_avx2:
        cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds)]
        cmd += ["--rows", args.rows, "--threads", str(args.threads)]
        cmd += ["--cpu-time"] if args.cpu_time else []
        env = {**os.environ, "NEFFKIT_CPU_ISA": "avx2"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write(proc.stdout.split("RESULT ")[0])
        tail = proc.stdout.split("RESULT ")[-1] if "RESULT " in proc.stdout else ""
        classes["avx2"] = json.loads(tail) if tail else {"error": proc.stderr[-1500:]}
    meta = {"layers": LAYERS, "calls": {n: [*c[0], c[1]] for n, c in CALLS.items()}}
    clock = "thread CPU time" if args.cpu_time else "wall"
    data = {**meta, "rounds": args.rounds, "threads": args.threads, "clock": clock}
    path = write_result("int8_rows", {**data, "classes": classes})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
