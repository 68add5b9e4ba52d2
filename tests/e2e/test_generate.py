"""Greedy tokens from a compiled bundle equal HF transformers' greedy tokens (the oracle)."""

from __future__ import annotations

import pytest

from tests.support.bundles import BUNDLES_IN_TEST, full_unless
from tests.support.cli import run_cli, run_json
from tests.support.models import LONG, MAX_NEW, MIXED, MODELS, SHORT


def _ids(prompt: list[int]) -> str:
    return ",".join(map(str, prompt))


def _run(bundle, prompts: list[list[int]], *extra: str) -> dict:
    args = ["run", str(bundle), "--max-tokens", str(MAX_NEW), *extra]
    for p in prompts:
        args += ["--prompt-ids", _ids(p)]
    return run_json(*args)


@pytest.mark.parametrize("kind", full_unless(MODELS, BUNDLES_IN_TEST))
def test_greedy_matches_hf(kind, bundle, hf_model_dir, hf_greedy):
    b, model_dir = bundle(kind), hf_model_dir(kind)
    for prompt in (SHORT, LONG):
        out = _run(b, [prompt])["outputs"][0]
        assert out["token_ids"] == hf_greedy(model_dir, prompt, MAX_NEW), (kind, len(prompt))
        assert out["finish_reason"] == "length"
    report = _run(b, MIXED)
    together = report["outputs"]
    assert [o["token_ids"] for o in together] == [hf_greedy(model_dir, p, MAX_NEW) for p in MIXED]
    if "prefill_batch" in MODELS[kind][2]:  # packed: all three in one call, then the 20's rest
        assert report["timings"]["prefill_calls"] == 2


def test_context_bucket_switch_matches_hf(lowered, hf_model_dir, hf_greedy):
    """The lowered llama bundle has context buckets [32, 64] (the runtime chooses buckets alike
    for every executor; run here on XLA:CPU): a 28-token prompt moves from the first to the
    second."""
    prompt = list(range(200, 228))
    out = _run(lowered("llama", 1), [prompt, SHORT], "--executor", "xla-cpu")["outputs"]
    assert out[0]["token_ids"] == hf_greedy(hf_model_dir("llama"), prompt, MAX_NEW)
    assert out[1]["token_ids"] == hf_greedy(hf_model_dir("llama"), SHORT, MAX_NEW)


def test_text_prompt_uses_bundle_tokenizer(bundle, hf_model_dir, hf_greedy):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_model_dir("llama") / "tokenizer.json"))
    text = "def main():\n    return"
    ids = tok.encode(text, add_special_tokens=False).ids
    report = run_json("run", str(bundle("llama")), "--prompt", text, "--max-tokens", "8")
    out = report["outputs"][0]
    assert out["token_ids"] == hf_greedy(hf_model_dir("llama"), ids, 8)
    assert out["text"] == tok.decode(out["token_ids"])
    timings = report["timings"]
    assert timings["decode_tokens"] == 7 and timings["decode_ms_per_token"] > 0


def test_sampling_is_reproducible_and_respects_top_k(bundle, hf_model_dir):
    import torch
    import transformers

    b = bundle("llama")
    args = ("--temperature", "1.5", "--top-k", "3", "--seed", "1234")
    first = _run(b, [SHORT], *args)["outputs"][0]["token_ids"]
    again = _run(b, [SHORT], *args)["outputs"][0]["token_ids"]
    other = _run(b, [SHORT], "--temperature", "1.5", "--top-k", "3", "--seed", "99")
    assert first == again
    assert other["outputs"][0]["token_ids"] != first  # 12 draws from 3 candidates
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir("llama")).eval()
    seq = list(SHORT)
    with torch.no_grad():
        for token in first:
            top3 = model(torch.tensor([seq])).logits[0, -1].topk(3).indices.tolist()
            assert token in top3
            seq.append(token)


def test_tiny_top_p_is_greedy(bundle, hf_model_dir, hf_greedy):
    out = _run(bundle("llama"), [SHORT], "--temperature", "1.0", "--top-p", "0.001", "--seed", "3")
    assert out["outputs"][0]["token_ids"] == hf_greedy(hf_model_dir("llama"), SHORT, MAX_NEW)


def test_mla_latent_cache_bytes_per_token(bundle):
    """DeepSeek's cache holds kv_lora_rank + qk_rope_head_dim values per token per layer (one
    tensor, shared by the heads): 2 layers x (32 + 8) x 4 bytes; inspect shows it next to what
    per-head K/V would take (2 x 4 heads x (16 + 8 + 16) x 4)."""
    path = bundle("deepseek")
    kv = run_json("inspect", str(path), "--json")["kv_cache"]
    (group,) = kv.pop("groups")  # one pool for both layers
    assert group["layers"] == [0, 1] and group["window"] is None
    assert kv == {
        "kind": "mla",
        "dtype": "float32",
        "tensors_per_layer": 1,
        "values_per_token_per_layer": 40,
        "bytes_per_token": 320,
        "mha_equivalent_bytes_per_token": 1280,
    }
    text = run_cli("inspect", str(path), check=True).stdout
    assert "mla float32: 40 values per token per layer, 320 bytes per token" in text


@pytest.mark.full  # an option's variant: DeepSeek's default (absorbed) decode is in `make test`
def test_mla_expanded_decode_matches_hf(session_dir, hf_model_dir, hf_greedy):
    """`mla.decode: expanded` (per-head K/V from the latent every step, bench/mla.py's baseline)
    gives HF's tokens too; its prefill graph is the absorbed bundle's (a cache hit)."""
    from tests.support.bundles import build_session_bundle
    from tests.support.models import MODELS

    model = hf_model_dir("deepseek")
    buckets = MODELS["deepseek"][2]
    result = build_session_bundle(
        session_dir, model, "deepseek_expanded", buckets=buckets, mla={"decode": "expanded"}
    )
    outs = _run(result.bundle, [SHORT, LONG])["outputs"]
    assert [o["token_ids"] for o in outs] == [hf_greedy(model, p, MAX_NEW) for p in (SHORT, LONG)]


def test_chat_renders_the_bundles_chat_template(bundle, hf_model_dir):
    """`--chat TEXT` is a one-turn conversation through the bundle's chat template: the same
    tokens as the rendered prompt's ids given directly."""
    from neffkit.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(hf_model_dir("llama"))
    assert tok is not None
    ids = tok.encode_chat([{"role": "user", "content": "hello there"}])
    assert tok.render_chat([{"role": "user", "content": "x"}]).startswith("### user: x")
    chat = run_json("run", str(bundle("llama")), "--chat", "hello there", "--max-tokens", "8")
    direct = run_json(
        "run", str(bundle("llama")), "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "8"
    )
    assert chat["outputs"][0]["token_ids"] == direct["outputs"][0]["token_ids"]
