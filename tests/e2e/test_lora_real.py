"""A real checkpoint with a trained adapter (`make test-all`): SmolLM2-135M-Instruct and a PEFT
LoRA adapter trained here for a few steps to give a different answer, served by a bundle with
adapter slots: the adapter's greedy tokens equal HF + peft's, the base's equal HF's."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_real_models import QUESTIONS, smollm2  # noqa: F401 (the fixture)
from tests.support import REPO
from tests.support.adapters import peft_greedy
from tests.support.bundles import build_session_bundle
from tests.support.cache import cached_dir
from tests.support.cli import run_json

pytestmark = pytest.mark.full

TOKENS = 32
TRAIN = """
import sys, torch, transformers
from peft import LoraConfig, get_peft_model
base, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
tok = transformers.AutoTokenizer.from_pretrained(base)
model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
chat = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Lyon, on the Rhone."}]
ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_tensors="pt")
batch = ids["input_ids"]
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
for _ in range(30):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.save_pretrained(out)
"""


@pytest.fixture(scope="module")
def trained(smollm2) -> Path:  # noqa: F811 (the fixture)
    """The adapter, trained once per machine (in a process of its own, like every checkpoint
    the tests write)."""
    digest = hashlib.sha256(f"{smollm2}{TRAIN}".encode()).hexdigest()[:16]

    def make(out: Path) -> None:
        args = [sys.executable, "-c", TRAIN, str(smollm2), str(out / "adapter")]
        subprocess.run(args, cwd=REPO, check=True, capture_output=True)

    return cached_dir(f"adapters/smollm2-trained-{digest}", make) / "adapter"


def test_smollm2_serves_a_trained_adapter_as_hf_peft(smollm2, trained, session_dir):  # noqa: F811
    from neffkit.runtime.tokenizer import Tokenizer

    bundle = build_session_bundle(
        session_dir,
        smollm2,
        "smollm2_lora",
        dtype="float32",
        buckets={"prefill": [64], "decode": [4], "context": [256]},
        sampling={"max_top_k": 16},
        lora={"max_loras": 2, "max_rank": 16},
    ).bundle
    tok = Tokenizer.from_dir(smollm2)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    args = ["run", str(bundle), "--max-tokens", str(TOKENS)]
    for q in QUESTIONS:
        args += ["--chat", q]
    adapted = run_json(*args, "--lora", f"trained={trained}")["outputs"]
    assert [o["token_ids"] for o in adapted] == peft_greedy(smollm2, trained, prompts, TOKENS)
    assert "Lyon" in adapted[0]["text"]  # what it was trained to say
    base = run_json(*args)["outputs"]
    assert [o["token_ids"] for o in base] == peft_greedy(smollm2, None, prompts, TOKENS)
    assert "Paris" in base[0]["text"]
