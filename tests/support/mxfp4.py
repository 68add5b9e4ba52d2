"""A tiny GPT-OSS in its mxfp4 release layout and its float twin (the oracle's checkpoint).

The experts of a random tiny GPT-OSS (MODELS["gpt_oss"], intermediate 128: the experts' dims
are whole groups of 32 and stay so when tp=2 halves the intermediate) are quantized to mxfp4 as
the release stores them: `<expert proj>_blocks` uint8 [E, rows, cols/32, 16] and `_scales` uint8
e8m0 [E, rows, cols/32] in the nn.Linear layout. The twin holds, in HF's float layout, exactly
what transformers' own `convert_moe_packed_tensors` widens them to (checked here against a numpy
widening, bit for bit), and no quantization_config.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.support import REPO
from tests.support.cache import cached_dir
from tests.support.models import COMMON, DEMO_MODEL, MODELS, TOKENIZER_FILES

CONFIG = {**COMMON, **MODELS["gpt_oss"][1], "intermediate_size": 128}
QUANT_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
PROJECTIONS = ("gate_up_proj", "down_proj")
# e2m1 by code (sign, 2 exponent bits, 1 mantissa bit), written out independently of neffkit's
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., rows, cols] → (blocks uint8 [..., rows, cols/32, 16], e8m0 scales uint8
    [..., rows, cols/32]): each group's scale the least power of two that fits its largest
    |w| in ±6, each value the nearest fp4 value; element 2i in a byte's low nibble."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(-1)
    exponent = np.ceil(np.log2(np.maximum(amax, 2.0**-100) / 6.0)).astype(np.int32)
    scaled = groups / np.exp2(exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4).argmin(-1).astype(np.uint8)
    return codes[..., 0::2] | codes[..., 1::2] << 4, (exponent + 127).astype(np.uint8)


def unpack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The values [..., rows, cols] float32 of `pack_mxfp4`'s output."""
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    scale = np.exp2(scales.astype(np.float64) - 127).astype(np.float32)
    values = FP4[codes] * scale[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def write_pair(root: Path, seed: int = 0) -> None:
    """root/mxfp4 (the release layout) and root/float (its twin). Run in a process of its own:
    transformers saves nothing where torch.distributed says rank != 0 (test_fp8's `_make`)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG))
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name and not param.any():  # HF starts biases at 0: random ones
                param.normal_(0.0, 0.2)
            if not name.endswith(PROJECTIONS):
                continue
            blocks, scales = pack_mxfp4(
                param.detach().transpose(1, 2).numpy()
            )  # rows × cols: nn.Linear
            b, s = (torch.from_numpy(np.ascontiguousarray(a)) for a in (blocks, scales))
            widened = convert_moe_packed_tensors(b, s, dtype=torch.float32)  # HF's layout
            mine = torch.from_numpy(unpack_mxfp4(blocks, scales)).transpose(1, 2)
            assert torch.equal(widened.view(torch.int32), mine.view(torch.int32)), name
            param.copy_(widened)
            packed[name + "_blocks"], packed[name + "_scales"] = b, s
    twin, mx = Path(root) / "float", Path(root) / "mxfp4"
    model.save_pretrained(twin)
    for file in TOKENIZER_FILES:
        shutil.copyfile(DEMO_MODEL / file, twin / file)
    shutil.copytree(twin, mx)
    tensors = load_file(twin / "model.safetensors")
    tensors = {n: t for n, t in tensors.items() if not n.endswith(PROJECTIONS)}
    save_file({**tensors, **packed}, mx / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mx / "config.json").read_text())
    (mx / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT_CONFIG}))


def mxfp4_models() -> tuple[Path, Path]:
    """(mxfp4 checkpoint, float twin), made once per machine in the test cache, keyed by the
    recipe, transformers' version and this module's source."""
    import torch
    import transformers

    recipe = [CONFIG, QUANT_CONFIG, transformers.__version__, torch.__version__]
    source = inspect.getsource(sys.modules[__name__])
    digest = hashlib.sha256(json.dumps([recipe, source]).encode()).hexdigest()[:16]

    def make(out: Path) -> None:
        code = "import sys; from tests.support.mxfp4 import write_pair; write_pair(sys.argv[1])"
        proc = subprocess.run(
            [sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    root = cached_dir(f"models/gpt_oss_mxfp4-{digest}", make)
    return root / "mxfp4", root / "float"
