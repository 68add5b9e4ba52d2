"""neffkit's decode-projection kernel on SmolLM2-135M's shapes, op by op.

A decode step of a small model makes many short kernel calls (SmolLM2: 7 projections in each of
30 layers, plus the LM head), and each call is one parallel region of torch's intra-op threads.
This script times, with random weights of SmolLM2's shapes (hidden 576, 192 K/V rows, MLP 1536,
a 49152 x 576 head), 2 threads, alternating rounds, medians:

- a step's layer projections as one call per weight (7 a layer) against one call per input
  (q/k/v together, o, gate/up together, down: 4 a layer), for float32 rows on float32 weights,
  bf16 rows on bf16 weights, and bf16 rows on block-fp8 weights (128 x 128);
- the LM head alone in bf16 and in fp8 (`lm_head: {dtype: float8_e4m3fn}`).

Every weight is its own tensor, 30 layers of them, so they stream from memory as in a step;
GB/s is the weight bytes a step streams over its time. The library is the one a build here
compiles: for the host's CPU class, or the class `$NEFFKIT_CPU_ISA` names (platform/isa.py), or
`--library`. Writes bench/results/kernels.json (kernels_avx2.json for the AVX2 class).

    .venv/bin/python bench/kernel_ops.py [--rounds 5]
    NEFFKIT_CPU_ISA=avx2 .venv/bin/python bench/kernel_ops.py   # the AVX2 class on this host
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, parse_args, timed, write_result  # noqa: E402

HIDDEN, KV, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152
THREADS = 2
# a layer's projections by the input they read: q/k/v, o, gate/up, down
GROUPS = ((HIDDEN, KV, KV), (HIDDEN,), (MLP, MLP), (HIDDEN,))
BLOCK = (128, 128)

Weight = tuple[torch.Tensor, torch.Tensor | None]  # (blocked weight, fp8 lane scales or None)


def make_weight(out: int, inp: int, kind: str) -> Weight:
    from neffkit.kernels.quant import lane_scales, quantize_blocks
    from neffkit.models.projection import to_blocked

    w = torch.randn(out, inp) * 0.05
    if kind != "fp8":
        return to_blocked(w.to(getattr(torch, kind)), 16), None
    q, grid = quantize_blocks(w, BLOCK)
    return to_blocked(q, 16), lane_scales(grid, (out, inp), BLOCK, 16)


def call(x: torch.Tensor, weights: list[Weight]) -> torch.Tensor:
    if weights[0][1] is None:
        return torch.ops.neffkit.blocked_rows(x, [w for w, _ in weights])
    scales = [s for _, s in weights]
    return torch.ops.neffkit.blocked_rows_fp8(x, [w for w, _ in weights], scales, BLOCK[1])


def timed_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    return 1000 * median([timed(fn) for _ in range(repeats)])


def layer_projections(kind: str, rounds: int) -> dict[str, dict[str, float]]:
    """One step's layer projections at 1 and 8 rows, per weight and per input."""
    layers = [
        [
            [make_weight(out, MLP if i == 3 else HIDDEN, kind) for out in group]
            for i, group in enumerate(GROUPS)
        ]
        for _ in range(LAYERS)
    ]
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    out: dict[str, dict[str, float]] = {}
    for rows in (1, 8):
        x = {HIDDEN: torch.randn(rows, HIDDEN).to(dtype), MLP: torch.randn(rows, MLP).to(dtype)}

        def per_weight(x: dict[int, torch.Tensor] = x) -> None:
            for groups in layers:
                for group in groups:
                    for w in group:
                        call(x[w[0].shape[1]], [w])

        def per_input(x: dict[int, torch.Tensor] = x) -> None:
            for groups in layers:
                for group in groups:
                    call(x[group[0][0].shape[1]], group)

        samples: dict[str, list[float]] = {"per_weight_ms": [], "per_input_ms": []}
        for _ in range(rounds):  # alternate: the host's noise hits both alike
            samples["per_weight_ms"].append(timed_ms(per_weight))
            samples["per_input_ms"].append(timed_ms(per_input))
        out[f"rows_{rows}"] = {k: round(median(v), 3) for k, v in samples.items()}
        out[f"rows_{rows}"]["per_input_gbs"] = gbs(layers, out[f"rows_{rows}"]["per_input_ms"])
    return out


def gbs(weights: object, ms: float) -> float:
    """GB/s of the weights (and fp8 scales) in `weights`, nested lists of tensors, in `ms`."""
    return round(nbytes(weights) / ms / 1e6, 1)


def nbytes(weights: object) -> int:
    if isinstance(weights, torch.Tensor):
        return weights.numel() * weights.element_size()
    parts = weights if isinstance(weights, list | tuple) else []
    return sum(nbytes(w) for w in parts)


def lm_head(rounds: int) -> dict[str, dict[str, float]]:
    heads = {kind: [make_weight(VOCAB, HIDDEN, kind)] for kind in ("bfloat16", "fp8")}
    out: dict[str, dict[str, float]] = {}
    for rows in (1, 8):
        x = torch.randn(rows, HIDDEN).bfloat16()
        samples: dict[str, list[float]] = {kind: [] for kind in heads}
        for _ in range(rounds):
            for kind, head in heads.items():
                samples[kind].append(timed_ms(lambda head=head, x=x: call(x, head)))
        out[f"rows_{rows}"] = {f"{k}_ms": round(median(v), 3) for k, v in samples.items()}
        for kind, head in heads.items():
            out[f"rows_{rows}"][f"{kind}_gbs"] = gbs(head, out[f"rows_{rows}"][f"{kind}_ms"])
    return out


def main() -> None:
    from neffkit.platform import cpu_kernels, isa

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--library", type=Path, help="a built libneffkit_cpu.so to time")
    args = parse_args(ap)
    if isa.chosen_class() is None:
        raise SystemExit("bench/kernel_ops.py: this CPU runs no class of the kernels (no AVX2)")
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    cpu_kernels.load_library(args.library or cpu_kernels.build_library())
    result = {
        "shapes": "SmolLM2-135M: hidden 576, K/V 192, MLP 1536, 30 layers, vocab 49152",
        "cpu_class": isa.chosen_class(),
        "threads": THREADS,
        "rounds": args.rounds,
        "layer_projections": {},
        "lm_head": lm_head(args.rounds),
    }
    for kind in ("float32", "bfloat16", "fp8"):
        result["layer_projections"][kind] = layer_projections(kind, args.rounds)
    print(f"{'weights':>9} {'rows':>4} {'7 calls a layer':>16} {'4 calls a layer':>16}")
    for kind, by_rows in result["layer_projections"].items():
        for rows, t in by_rows.items():
            n = rows.removeprefix("rows_")
            print(
                f"{kind:>9} {n:>4} {t['per_weight_ms']:>13.2f} ms {t['per_input_ms']:>13.2f} ms"
                f" {t['per_input_gbs']:>6.1f} GB/s"
            )
    for rows, t in result["lm_head"].items():
        n = rows.removeprefix("rows_")
        print(
            f"LM head, {n} row(s): bf16 {t['bfloat16_ms']:.3f} ms ({t['bfloat16_gbs']} GB/s),"
            f" fp8 {t['fp8_ms']:.3f} ms ({t['fp8_gbs']} GB/s)"
        )
    name = "kernels" if isa.requested() == "native" else f"kernels_{isa.requested()}"
    print(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
