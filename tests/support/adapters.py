"""PEFT LoRA adapters of a test checkpoint, made by peft itself (the oracle's library) and kept in
the test cache: random nonzero A and B, various ranks and targets."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO
from tests.support.bundles import build_session_bundle, lowered_build, prebuild
from tests.support.cache import cached_dir
from tests.support.models import LONG, MIXED, SHORT

# the lora_bundle fixture's (tests/e2e/conftest.py): two slots of rank up to 16, n-gram speculation
LORA_BUCKETS = {"prefill": [16], "prefill_batch": [1, 4], "decode": [4], "context": [64]}
REPEATS = [5, 6, 7, 8, 9] * 3  # prompt lookup proposes its continuation
# the prompts the `oracle` fixture continues, under the base and each adapter it serves
PROMPTS = [SHORT, LONG, *MIXED, REPEATS]
ORACLE_NAMES = [None, "attn4", "all8", "mlp16"]

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name → rank, targets, extra LoraConfig fields, seed
ADAPTERS: dict[str, tuple[int, list[str], dict[str, Any], int]] = {
    "attn4": (4, ["q_proj", "v_proj"], {}, 1),
    "all8": (8, ALL, {"lora_alpha": 24}, 2),
    "mlp16": (16, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}, 3),
    "wide32": (32, ["q_proj"], {}, 4),  # above the test bundles' max_rank
    "qkvo8": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], {}, 5),  # attention: MoE models too
}
DENSE = ("attn4", "all8", "mlp16", "wide32")
ATTENTION = ("attn4", "qkvo8")

_MAKE = """
import json, sys, torch, transformers
from peft import LoraConfig, get_peft_model
base, out, recipe = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for name, (rank, targets, extra, seed) in recipe.items():
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, target_modules=targets, init_lora_weights=False, **extra)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # deltas that change a tiny random model's greedy tokens
        for key, tensor in peft_model.named_parameters():
            if "lora_" in key:
                tensor.normal_(0.0, 0.3)
    peft_model.save_pretrained(f"{out}/{name}")
"""


def make_adapters(model_dir: Path, names: tuple[str, ...] = DENSE) -> dict[str, Path]:
    """ADAPTERS `names` of the checkpoint at `model_dir`, by name (made once per machine, in a
    process of its own: a test worker may hold tracing's fake process group, under which
    transformers and peft save nothing)."""
    import peft

    recipe = json.dumps({n: ADAPTERS[n] for n in names}, sort_keys=True)
    digest = hashlib.sha256(f"{model_dir}{recipe}{peft.__version__}{_MAKE}".encode()).hexdigest()

    def make(out: Path) -> None:
        args = [sys.executable, "-c", _MAKE, str(model_dir), str(out), recipe]
        subprocess.run(args, cwd=REPO, check=True, capture_output=True)

    root = cached_dir(f"adapters/{model_dir.name}-{digest[:16]}", make)
    return {name: root / name for name in names}


def peft_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> Any:
    """HF + peft's greedy continuations (the base alone where `adapter` is None)."""
    import torch
    import transformers
    from peft import PeftModel

    from tests.support.models import hf_greedy_ids

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    return [hf_greedy_ids(model, prompt, n) for prompt in prompts]


@prebuild("llama_lora")
def build_lora_bundle(session_dir: Path, hf_model_dir: Any) -> Path:
    """The tiny Llama with two adapter slots of rank up to 16 on every projection, and n-gram
    speculation (verify graphs): the multi-LoRA tests' (test_lora.py, test_lora_server.py)."""
    return build_session_bundle(
        session_dir,
        hf_model_dir("llama"),
        "llama_lora",
        buckets=LORA_BUCKETS,
        lora={"max_loras": 2, "max_rank": 16},
        speculation={"method": "ngram", "num_tokens": 3},
    ).bundle


@prebuild("mixtral_lora_neuron_tp2")
def build_moe_lora_lowered(session_dir: Path, hf_model_dir: Any) -> Path:
    """Mixtral with attention adapter slots at tp=2, ep=2, lowered to HLO (test_lora_parallel)."""
    return lowered_build(
        session_dir,
        hf_model_dir("mixtral"),
        "mixtral_lora_neuron_tp2",
        "--lower-only",
        buckets={"prefill": [16], "prefill_batch": [1, 2], "decode": [2], "context": [64]},
        parallel={"tp": 2, "ep": 2},
        lora={"max_loras": 2, "max_rank": 8},
    )
