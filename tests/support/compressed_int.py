"""Tiny compressed-tensors integer checkpoints written by the library itself, and their float
twins (the oracle's checkpoints).

A random tiny Llama (hidden 256, intermediate 512: two and four groups of 128 a row) gets a
QuantizationConfig applied by compressed-tensors (`apply_quantization_config`), its scales and
zero points from `calculate_qparams` over each group's min and max (llm-compressor's min-max
observer, without llm-compressor), and is compressed by `ModelCompressor` and saved as
llm-compressor saves (`compress_model`, `save_pretrained`, `update_config`). The twin holds,
in each quantized module's weight, exactly what the library's own compressor decompresses
the saved tensors to (float32 scales: the values neffkit's graph widens to), and no
quantization_config.
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

from tests.support import REPO
from tests.support.cache import cached_dir
from tests.support.models import COMMON, DEMO_MODEL, TOKENIZER_FILES

CONFIG = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "initializer_range": 0.05}
INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
# name → (format, weights' QuantizationArgs, input activations' or None)
RECIPES: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
    "w4a16_asym_g128": (
        "pack-quantized",
        {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128},
        None,
    ),
    "w8a16_channel": (
        "pack-quantized",
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        None,
    ),
    "w8a8": (
        "int-quantized",
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        INT8_TOKEN,
    ),
}
IGNORE = ["lm_head"]


def calibrate(model: Any, args: Any) -> None:
    """Each quantized module's weight_scale (and weight_zero_point) from its groups' min and
    max, by the library's `calculate_qparams`."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight
            rows = w.unflatten(-1, (-1, args.group_size)) if args.group_size else w.unsqueeze(-2)
            scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero)


def write_pair(root: str, name: str, seed: int = 0) -> None:
    """root/ct (the compressed checkpoint) and root/float (its twin). Run in a process of its
    own: transformers saves nothing where torch.distributed says rank != 0."""
    import torch
    import transformers
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from safetensors.torch import load_file, save_file

    fmt, weights, acts = RECIPES[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=args,
        input_activations=QuantizationArgs(**acts) if acts else None,
    )
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE, format=fmt)
    apply_quantization_config(model, config)
    calibrate(model, args)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    ct, twin = Path(root) / "ct", Path(root) / "float"
    model.save_pretrained(ct)
    compressor.update_config(str(ct))
    stored = load_file(ct / "model.safetensors")
    tensors = {n: t for n, t in stored.items() if not n.rsplit(".", 1)[1].startswith("weight_")}
    decompress = BaseCompressor.load_from_registry(fmt).decompress
    for module in {n.rsplit(".", 1)[0] for n in stored if n.endswith(".weight_scale")}:
        parts = {n.removeprefix(module + "."): t for n, t in stored.items() if n.startswith(module)}
        tensors[module + ".weight"] = decompress(parts, scheme)["weight"].float().contiguous()
    twin.mkdir()
    save_file(tensors, twin / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((ct / "config.json").read_text())
    raw.pop("quantization_config")
    (twin / "config.json").write_text(json.dumps(raw))
    shutil.copyfile(ct / "generation_config.json", twin / "generation_config.json")
    for file in TOKENIZER_FILES:
        for out in (ct, twin):
            shutil.copyfile(DEMO_MODEL / file, out / file)


def compressed_models(name: str) -> tuple[Path, Path]:
    """(compressed-tensors checkpoint, float twin) of RECIPES[name], made once per machine in
    the test cache, keyed by the recipe, the libraries' versions and this module's source."""
    import compressed_tensors
    import torch
    import transformers

    versions = [compressed_tensors.__version__, transformers.__version__, torch.__version__]
    recipe = [CONFIG, RECIPES[name], IGNORE, versions]
    source = inspect.getsource(sys.modules[__name__])
    digest = hashlib.sha256(json.dumps([recipe, source]).encode()).hexdigest()[:16]

    def make(out: Path) -> None:
        code = (
            "import sys; from tests.support.compressed_int import write_pair; "
            "write_pair(sys.argv[1], sys.argv[2])"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(out), name], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    root = cached_dir(f"models/ct_{name}-{digest}", make)
    return root / "ct", root / "float"
