"""Quantize an HF checkpoint to DeepSeek-style block fp8, and write its exact dequantization too.

Every projection weight (attention q/k/v/o and the MLA projections, MLP and expert gate/up/down)
becomes float8_e4m3fn with one float32 `weight_scale_inv` per [block_out, block_in] block (the
last block of each dimension partial where the block does not divide it), as DeepSeek-V3 ships;
config.json gets `quantization_config: {quant_method: fp8, weight_block_size: [...]}`. Embedding,
LM head, norms and routers stay as they are. `--dequantized DIR` also writes the same model with
each quantized weight replaced by its exact dequantization in float32 and no quantization config:
the HF oracle for the fp8 bundle. Usage:

    python tools/make_fp8_model.py SRC OUT [--block 128 128] [--dequantized DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
QUANTIZED = re.compile(r"(_proj|\.w[123]|kv_a_proj_with_mqa)\.weight$")


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows = scale.repeat_interleave(block[0], dim=-2)[..., : shape[-2], :]
    return rows.repeat_interleave(block[1], dim=-1)[..., : shape[-1]]


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv per block): weight ≈ fp8.float() * scale_inv."""
    w = weight.float()
    rows, cols = w.shape[-2:]
    pad_r, pad_c = -rows % block[0], -cols % block[1]
    padded = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    blocks = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., row blocks, col blocks]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--dequantized", type=Path)
    args = ap.parse_args()
    block = (args.block[0], args.block[1])
    tensors = load_file(args.src / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if QUANTIZED.search(name) and t.dim() >= 2:
            q, scale = quantize(t, block)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            exact[name] = q.float() * _expand(scale, q.shape, block)
        else:
            quantized[name], exact[name] = t, t.float()
    for out, data, quant in ((args.out, quantized, True), (args.dequantized, exact, False)):
        if out is None:
            continue
        shutil.copytree(args.src, out, dirs_exist_ok=True)
        save_file(data, out / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        if quant:
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": list(block)}  # fmt: skip
        else:
            cfg.pop("quantization_config", None)
            cfg["torch_dtype"] = cfg["dtype"] = "float32"
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{args.out}: {sum(1 for n in quantized if n.endswith('_scale_inv'))} fp8 tensors")


if __name__ == "__main__":
    main()
