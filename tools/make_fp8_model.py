"""Quantize an HF checkpoint to fp8 as the common formats ship it, and write its exact
dequantization too.

Every projection weight (attention q/k/v/o and the MLA projections, MLP and expert gate/up/down)
becomes float8_e4m3fn with float32 scales, multiplied in (weight ≈ fp8.float() * scale):
- `--format fp8` (default): DeepSeek-V3's fine-grained blocks, one `weight_scale_inv` per
  [block_out, block_in] block (the last block of each dimension partial where the block does not
  divide it); config.json gets `quantization_config: {quant_method: fp8, weight_block_size}`.
- `--format compressed-tensors --scheme tensor|channel|block`: `weight_scale` of shape [1],
  [out, 1] or the block grid; a float-quantized compressed-tensors config (dynamic per-token
  activations, as llm-compressor's FP8_DYNAMIC writes it).
- `--format fbgemm_fp8`: per-channel `weight_scale` [out, 1] (Meta's Llama 3.1 405B FP8 layout).
Embedding, LM head, norms and routers stay as they are. `--kv-scales` also writes each layer's
`self_attn.k_scale` / `v_scale` (compressed-tensors' kv_cache_scheme): the largest |K| / |V| the
source model produces over a few random prompts, with a 25% margin, over 448. `--dequantized DIR`
writes the same model with each quantized weight replaced by its exact dequantization in float32
and no quantization config: the HF oracle for the fp8 bundle. Usage:

    python tools/make_fp8_model.py SRC OUT [--format fp8] [--block 128 128] [--scheme block]
        [--kv-scales] [--dequantized DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from neffkit.kernels.quant import expand_scales, quantize_blocks
from neffkit.targets import E4M3FN_MAX

QUANTIZED = re.compile(r"(_proj|\.w[123]|kv_a_proj_with_mqa)\.weight$")
SCHEMES = {"tensor": (0, 0), "channel": (1, 0)}


def _config(fmt: str, scheme: str, block: tuple[int, int], kv_scales: bool) -> dict:
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    if fmt == "fbgemm_fp8":
        return {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        }
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": scheme,
        "block_structure": list(block) if scheme == "block" else None,
    }
    activations = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": True,
        "strategy": "token",
    }
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": kv if kv_scales else None,
    }


def calibrate_kv_scales(src: Path, prompts: int = 4, length: int = 48) -> dict[str, torch.Tensor]:
    """Per-layer k_scale / v_scale: max |K| (after RoPE, as the cache stores it) and max |V|
    over random prompts, with a 25% margin, over 448."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def keep(name: str, value: torch.Tensor) -> None:
        amax[name] = max(amax.get(name, 0.0), float(value.abs().max()))

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prompts, length), generator=gen)
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        keep(f"model.layers.{i}.self_attn.k_scale", layer.keys)
        keep(f"model.layers.{i}.self_attn.v_scale", layer.values)
    return {n: torch.tensor([1.25 * a / E4M3FN_MAX]) for n, a in amax.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--format", choices=["fp8", "compressed-tensors", "fbgemm_fp8"], default="fp8")
    ap.add_argument("--scheme", choices=["block", "channel", "tensor"], default="block")
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--kv-scales", action="store_true")
    ap.add_argument("--dequantized", type=Path)
    args = ap.parse_args()
    scheme = {"fp8": "block", "fbgemm_fp8": "channel"}.get(args.format, args.scheme)
    block = SCHEMES.get(scheme, (args.block[0], args.block[1]))
    suffix = "_scale_inv" if args.format == "fp8" else "_scale"
    tensors = load_file(args.src / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if QUANTIZED.search(name) and t.dim() >= 2:
            q, scale = quantize_blocks(t, block)
            if scheme == "tensor":
                scale = scale.reshape(1)  # compressed-tensors' per-tensor shape
            quantized[name], quantized[name + suffix] = q, scale
            exact[name] = q.float() * expand_scales(scale, tuple(q.shape), block)
        else:
            quantized[name], exact[name] = t, t.float()
    if args.kv_scales:
        quantized.update(calibrate_kv_scales(args.src))
    for out, data, quant in ((args.out, quantized, True), (args.dequantized, exact, False)):
        if out is None:
            continue
        shutil.copytree(args.src, out, dirs_exist_ok=True)
        save_file(data, out / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        if quant:
            cfg["quantization_config"] = _config(args.format, scheme, block, args.kv_scales)
        else:
            cfg.pop("quantization_config", None)
            cfg["torch_dtype"] = cfg["dtype"] = "float32"
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    fp8 = sum(1 for t in quantized.values() if t.dtype == torch.float8_e4m3fn)
    print(f"{args.out}: {fp8} fp8 tensors ({scheme} scales)")


if __name__ == "__main__":
    main()
