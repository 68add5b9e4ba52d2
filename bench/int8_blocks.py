"""neffkit::int8_blocks (csrc/int8_blocks.cpp: rows quantized to int8 per block of 32 inputs,
integer products with the weight's codes) against neffkit::packed_rows (csrc/packed_rows.cpp:
float32 rows, each code decoded to its float value) on the same weights, call by call.

SmolLM2-135M's projections (q 576 x 576; k/v 192 x 576, both in one call; gate/up 1536 x 576,
both in one call; down 576 x 1536; the 49152 x 576 head) in two GGUF formats: Q8_0 (8-bit
codes q + 128, a scale per 32 inputs: bits 8, kind sym, zero 128) and Q4_1 (4-bit codes, a
scale and an additive minimum per 32 inputs: bits 4, kind min). Random codes and scales; as many
copies of each call's weights as stream at least 32 MB a round (a decode step's weights are not
in L2). One thread (`torch.set_num_threads(1)`), its CPU time (the host is
shared), for 1 and 8 rows; each round times every variant once, alternating; medians. Variants:
packed_rows, and int8_blocks on each path this library has (VNNI, AVX2: `int8_blocks_path`).
The AVX2 class (`$NEFFKIT_CPU_ISA=avx2`: the library built for -march=x86-64-v3) runs in a
child process. Prints a table; `--json PATH` writes the figures.

    .venv/bin/python bench/int8_blocks.py [--rounds 9] [--rows 1,8] [--no-avx2] [--json out.json]
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
from common import median, parse_args  # noqa: E402

HIDDEN, KV, MLP, VOCAB = 576, 192, 1536, 49152
# one call each: the weights reading one input, and their input width
CALLS = {
    "q": ((HIDDEN,), HIDDEN),
    "k/v": ((KV, KV), HIDDEN),
    "gate/up": ((MLP, MLP), HIDDEN),
    "down": ((HIDDEN,), MLP),
    "head": ((VOCAB,), HIDDEN),
}
# format: (bits, kind, zero) of int8_blocks, and the QuantScheme id packed_rows reads
FORMATS = {"q8_0": (8, 0, 128), "q4_1": (4, 2, 0)}
SCHEMES = {"q8_0": "sym:b8:g32:z128", "q4_1": "min:b4:g32"}
PATHS = {"vnni": 1, "avx2": 0}
STREAM_BYTES = 32 << 20  # bytes of codes a round streams at least

Parts = list[dict[str, torch.Tensor]]


def make_weights(fmt: str, outputs: tuple[int, ...], k: int) -> list[Parts]:
    """Copies of one call's weights (codes, scales, minimums) in the format's layout."""
    from neffkit.kernels.intquant import MIN, SCALE, QuantScheme, pack_codes

    bits = FORMATS[fmt][0]
    scheme = QuantScheme.from_id(SCHEMES[fmt])
    copies = max(1, -(-STREAM_BYTES // (sum(outputs) * k * bits // 8)))
    out = []
    for _ in range(copies):
        parts = []
        for n in outputs:
            codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
            part = {**pack_codes(codes, bits), SCALE: torch.rand(n, k // 32) / 64}
            if scheme.aux:
                part[MIN] = -8 * part[SCALE]
            parts.append(part)
        out.append(parts)
    return out


def variants(fmt: str, layers: list[Parts], x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """packed_rows, and int8_blocks on each of this library's paths, over every copy."""
    from neffkit.kernels.intquant import MIN, SCALE, QuantScheme, kernel_table

    bits, kind, zero = FORMATS[fmt]
    base, mode = kernel_table(QuantScheme.from_id(SCHEMES[fmt]), x.device)
    args = []
    for parts in layers:
        scales = [p[SCALE] for p in parts]
        aux = [p[MIN] for p in parts] if kind else scales
        args.append(([p[""] for p in parts], scales, aux))

    def packed() -> None:
        for c, s, a in args:
            torch.ops.neffkit.packed_rows(x, c, s, a, base, mode)

    out: dict[str, Callable[[], Any]] = {"packed_rows": packed}
    for name in kernel_paths():

        def blocks(p: int = PATHS[name]) -> None:
            torch.ops.neffkit.int8_blocks_path(p)
            for c, s, a in args:
                torch.ops.neffkit.int8_blocks(x, c, s, a, bits, kind, zero)

        out[f"int8_blocks {name}"] = blocks
    return out


def kernel_paths() -> list[str]:
    """The paths this library has (int8_blocks_path grants at most what is asked)."""
    return [name for name, p in PATHS.items() if torch.ops.neffkit.int8_blocks_path(p) == p]


def time_call(fmt: str, name: str, rows: int, rounds: int) -> dict[str, float]:
    """ms a call of each variant: medians over rounds of one thread's CPU time."""
    outputs, k = CALLS[name]
    layers = make_weights(fmt, outputs, k)
    fns = variants(fmt, layers, torch.randn(rows, k))
    for fn in fns.values():  # warm up
        fn()
    times: dict[str, list[float]] = {v: [] for v in fns}
    for _ in range(rounds):
        for v, fn in fns.items():
            t0 = time.thread_time()
            fn()
            times[v].append((time.thread_time() - t0) / len(layers))
    torch.ops.neffkit.int8_blocks_path(-1)
    return {v: round(1e3 * median(t), 4) for v, t in times.items()}


def load_library() -> str:
    """The build's library for this process's class (platform/isa.py)."""
    from neffkit.platform import cpu_kernels

    path = cpu_kernels.build_library()
    cpu_kernels.load_library(path)
    return path.name


def run_class(args: argparse.Namespace) -> dict[str, Any]:
    """Every format, call and row count in this process (its class: $NEFFKIT_CPU_ISA)."""
    from neffkit.platform import isa

    library = load_library()
    out: dict[str, Any] = {"class": isa.chosen_class(), "library": library, "calls": {}}
    for fmt in FORMATS:
        for name in CALLS:
            for rows in (int(r) for r in args.rows.split(",")):
                result = time_call(fmt, name, rows, args.rounds)
                out["calls"][f"{fmt} {name} {rows}"] = result
                print(row_line(out["class"], fmt, name, rows, result), flush=True)
    return out


def row_line(cls: str, fmt: str, name: str, rows: int, result: dict[str, float]) -> str:
    packed = result["packed_rows"]
    cells = [f"packed_rows {packed:8.4f} ms"]
    for v, ms in result.items():
        if v != "packed_rows":
            cells.append(f"{v} {ms:8.4f} ms ({packed / ms:4.2f}x)")
    return f"{cls:6} {fmt:5} {name:8} {rows:2} rows  " + "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", default="1,8", help="row counts (packed_rows: 1 to 8)")
    parser.add_argument("--no-avx2", action="store_true", help="skip the AVX2 class")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(parser)
    torch.set_num_threads(1)
    result = run_class(args)
    if args.child:
        print("RESULT " + json.dumps(result))
        return
    classes = {"native": result}
    if not args.no_avx2:
        classes["avx2"] = avx2_child(args)
    if args.json:
        data = {"threads": 1, "clock": "thread CPU time", "rounds": args.rounds}
        Path(args.json).write_text(json.dumps({**data, "classes": classes}, indent=2) + "\n")
        print(f"wrote {args.json}")


def avx2_child(args: argparse.Namespace) -> dict[str, Any]:
    """The same in a child process for the AVX2 class (its own library build)."""
    cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--rows", args.rows]
    env = {**os.environ, "NEFFKIT_CPU_ISA": "avx2"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(proc.stdout.split("RESULT ")[0])
    if "RESULT " not in proc.stdout:
        print(proc.stderr[-1500:])
        return {"error": proc.stderr[-1500:]}
    result: dict[str, Any] = json.loads(proc.stdout.split("RESULT ")[-1])
    return result


if __name__ == "__main__":
    main()
