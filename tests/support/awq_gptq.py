"""Tiny AWQ and GPTQ checkpoints as AutoAWQ and GPTQModel write them, and their float twins.

The writers follow the libraries' own code, not neffkit's: AWQ as AutoAWQ's
`pseudo_quantize_tensor` (asymmetric, zero point per group) and `WQLinear_GEMM.from_linear`
(codes and zero points eight to an int32 in the order AWQ_ORDER, the weight transposed); GPTQ as
its quantizer (symmetric: scale 2 * absmax / maxq, zero point 2^(bits-1)) and GPTQModel's pack
(inputs packed along qweight's rows, outputs along qzeros' columns, zero points stored less one
in checkpoint_format gptq). The twin is the same model without quantization_config whose
projection weights are (q - z) * scale in float32, computed here from the writer's own codes.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.support.cache import cached_dir

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8c + order[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _words(values: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as the int32 a checkpoint stores (the same 32 bits)."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def awq_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """AutoAWQ's zero-point quantization of a float [out, in] weight: (codes [out, in], zero
    points [out, in/group], float16 scales [out, in/group]); the codes are made against the
    float16 scales the checkpoint stores, so widening them is exact."""
    blocks = w.float().unflatten(-1, (-1, group))
    hi, lo = blocks.amax(-1), blocks.amin(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(lo / scales.float())).clamp(0, 15)
    codes = torch.round(blocks / scales.float()[..., None]) + zeros[..., None]
    return codes.clamp(0, 15).flatten(-2).long(), zeros.long(), scales


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict:
    """AutoAWQ's WQLinear_GEMM tensors (qweight [in, out/8], qzeros, scales [in/group, out])."""

    def pack(values: torch.Tensor) -> torch.Tensor:  # [rows, cols] → [rows, cols/8]
        out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
        return _words(out)

    return {
        "qweight": pack(codes.t()),
        "qzeros": pack(zeros.t()),
        "scales": scales.t().contiguous(),
    }


def gptq_quantize(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, ...]:
    """GPTQ's symmetric quantization (no error feedback: the layout is what is tested):
    (codes [out, in], zero points [out, groups] all 2^(bits-1), float16 scales)."""
    g = group if group > 0 else w.shape[-1]
    blocks = w.float().unflatten(-1, (-1, g))
    maxq = 2**bits - 1
    xmax = blocks.abs().amax(-1).clamp(min=1e-5)
    scales = (2 * xmax / maxq).half()
    zeros = torch.full_like(xmax, (maxq + 1) // 2).long()
    codes = torch.round(blocks / scales.float()[..., None]) + zeros[..., None]
    return codes.clamp(0, maxq).flatten(-2).long(), zeros, scales


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, **cfg: Any) -> dict:
    """GPTQModel's tensors: qweight [in*bits/32, out], qzeros [groups, out*bits/32] (less one
    in checkpoint_format gptq), scales [groups, out], g_idx [in] = i // group."""
    bits, per = cfg["bits"], 32 // cfg["bits"]
    intweight = codes.t()  # [in, out]
    qweight = torch.zeros(intweight.shape[0] // per, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << (bits * j)
    stored = zeros.t() - (1 if cfg["checkpoint_format"] == "gptq" else 0)  # [groups, out]
    qzeros = torch.zeros(stored.shape[0], stored.shape[1] // per, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= stored[:, col * per + j] << (bits * j)
    rows = codes.shape[1]
    group = cfg["group_size"] if cfg["group_size"] > 0 else rows
    return {
        "qweight": _words(qweight),
        "qzeros": _words(qzeros),
        "scales": scales.t().contiguous(),
        "g_idx": (torch.arange(rows) // group).to(torch.int32),
    }


def widened(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q - z) * scale in float32, per group of inputs: the twin's weight."""
    group = codes.shape[-1] // scales.shape[-1]
    z = zeros.float().repeat_interleave(group, -1)
    return (codes.float() - z) * scales.float().repeat_interleave(group, -1)


def awq_config(group: int) -> dict:
    """config.json's quantization_config as AutoAWQ writes it (to_transformers_dict)."""
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def gptq_config(bits: int, group: int, checkpoint_format: str = "gptq") -> dict:
    """config.json's quantization_config as GPTQModel writes it (QuantizeConfig.to_dict)."""
    return {
        "bits": bits,
        "group_size": group,
        "desc_act": False,
        "sym": True,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "meta": {"quantizer": ["gptqmodel:4.0.0"], "damp_percent": 0.05, "true_sequential": True},
    }


def quantize_module(w: torch.Tensor, quant: dict) -> tuple[dict, torch.Tensor]:
    """(the stored tensors by suffix, the twin's float32 weight) of one [out, in] weight."""
    if quant["quant_method"] == "awq":
        codes, zeros, scales = awq_quantize(w, quant["group_size"])
        return pack_awq(codes, zeros, scales), widened(codes, zeros, scales)
    codes, zeros, scales = gptq_quantize(w, quant["bits"], quant["group_size"])
    return pack_gptq(codes, zeros, scales, **quant), widened(codes, zeros, scales)


def write_pair(src: Path, out: Path, twin: Path, quant: dict) -> None:
    """The quantized checkpoint (out) and its float twin from a float32 HF checkpoint."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    stored: dict[str, torch.Tensor] = {}
    exact = dict(tensors)
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in PROJECTIONS or not name.endswith(".weight"):
            stored[name] = value
            continue
        parts, exact[name] = quantize_module(value, quant)
        stored.update({f"{module}.{k}": v for k, v in parts.items()})
    for root, tensors_out in ((out, stored), (twin, exact)):
        shutil.copytree(src, root, dirs_exist_ok=True)
        save_file(tensors_out, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))


def make_pair(name: str, fields: dict, quant: dict) -> tuple[Path, Path]:
    """(quantized checkpoint, float twin) of a random float32 Llama of `fields`, made once per
    machine in the test cache (keyed by the recipe and this module's source)."""
    import transformers

    model = hashlib.sha256(json.dumps([fields, transformers.__version__]).encode()).hexdigest()
    recipe = [model, quant, inspect.getsource(sys.modules[__name__])]
    digest = hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]

    def source(out: Path) -> None:  # a process of its own: the seed alone decides the weights
        code = (
            "import sys, torch, transformers; torch.manual_seed(0); "
            f"c = transformers.LlamaConfig(**{fields!r}, dtype='float32'); "
            "transformers.AutoModelForCausalLM.from_config(c).save_pretrained(sys.argv[1])"
        )
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, capture_output=True)

    def pair(root: Path) -> None:
        src = cached_dir(f"models/awq_gptq_source-{model[:16]}", source)
        write_pair(src, root / "quantized", root / "twin", quant)

    root = cached_dir(f"models/{name}-{digest}", pair)
    return root / "quantized", root / "twin"
