"""Embed bundles (`task: embed`) against HF `AutoModel`'s last_hidden_state pooled the same way:
one input, 16 of mixed lengths at once (packed into shared prefill calls), and inputs longer than
the largest prefill bucket (pooled across chunks); offline, at tp=2 through the CLI, and on a
real server through the openai client (float and base64); an embed bundle refuses the
generating routes by name (test_tokenize_server: a generate bundle refuses /v1/embeddings)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.support.bundles import build_session_bundle
from tests.support.cache import cached_dir
from tests.support.cli import run_cli
from tests.support.models import model_dir_name
from tests.support.server import Server

pytestmark = pytest.mark.xdist_group("embeddings")

# one-row and packed four-row prefill graphs of 16 tokens: a 50-token input takes 4 chunks
BUCKETS = {"prefill": [16], "prefill_batch": [1, 4], "context": [64]}
LENGTHS = (1, 2, 3, 5, 7, 9, 12, 15, 16, 17, 20, 25, 31, 33, 40, 50)
BATCH = [[(7 * i + 3 * j) % 1000 + 2 for j in range(n)] for i, n in enumerate(LENGTHS)]
LONG = BATCH[-1]
MIN_COSINE = 0.9999


def embed_bundle(session_dir: Path, model: Path, name: str, pooling: str, **extra) -> Path:
    return build_session_bundle(
        session_dir,
        model,
        name,
        task="embed",
        embedding={"pooling": pooling, "normalize": True},
        sampling=None,
        buckets=BUCKETS,
        **extra,
    ).bundle


def hf_embeddings(model_dir: Path, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    """The oracle: transformers' AutoModel (no LM head), its last_hidden_state pooled by the
    rule (last token, mean of the tokens, first token) and normalized to unit length."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            states = model(torch.tensor([prompt])).last_hidden_state[0].double()
            pooled = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
            out.append((pooled / pooled.norm()).numpy())
    return out


def assert_close(got: list, want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = np.asarray(g, dtype=np.float64)
        assert g.shape == w.shape, i
        assert abs(np.linalg.norm(g) - 1) < 1e-5, i  # normalized
        cosine = float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w)))
        assert cosine >= MIN_COSINE, (i, len(BATCH[i]) if len(got) == len(BATCH) else None, cosine)


@pytest.mark.parametrize("pooling", ["last", "mean", pytest.param("cls", marks=pytest.mark.full)])
def test_offline_embeddings_equal_hf_pooled(session_dir, hf_model_dir, pooling):
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    model = hf_model_dir("qwen3")
    bundle = embed_bundle(session_dir, model, f"qwen3_embed_{pooling}", pooling)
    llm = LLM(load(bundle))
    want = hf_embeddings(model, BATCH, pooling)
    assert_close(llm.embed([BATCH[4]]), [want[4]])  # alone
    assert_close(llm.embed([LONG]), [want[-1]])  # four chunks
    calls = llm.core.runner.timings.prefill_chunks
    assert_close(llm.embed(BATCH), want)  # together: packed, the long ones chunked
    alone = sum(-(-n // BUCKETS["prefill"][0]) for n in LENGTHS)  # each input's own chunks
    assert llm.core.runner.timings.prefill_chunks - calls < alone  # packed: calls shared
    with pytest.raises(Exception, match="computes embeddings"):
        from neffkit.runtime.sampling_params import SamplingParams

        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_embed_bundle_records_its_task_and_has_no_decode_graphs(session_dir, hf_model_dir):
    bundle = embed_bundle(session_dir, hf_model_dir("qwen3"), "qwen3_embed_mean", "mean")
    record = json.loads((bundle / "bundle.json").read_text())
    assert {g["phase"] for g in record["graphs"]} == {"prefill"}
    assert record["layout"]["pooling"] == {"pooling": "mean", "normalize": True, "width": 64}
    assert record["layout"]["prefix_caching"] is False
    assert all(g["outputs"][0]["name"] == "pooled" for g in record["graphs"])
    assert not any(w.startswith("lm_head") for g in record["graphs"] for w in _inputs(g))
    shown = run_cli("inspect", str(bundle), check=True).stdout
    assert "mean pooling, 64 values, normalized" in shown
    summary = json.loads(run_cli("inspect", str(bundle), "--json", check=True).stdout)
    assert summary["task"] == "embed"


def test_build_verify_holds_an_embed_bundle_to_its_eager_pooling(
    session_dir, hf_model_dir, tmp_path
):
    """`build --verify`: each pooled graph against the eager model (its pooled states held to
    the K/V tolerance; nothing sampled to compare)."""
    from tests.support.cache import artifact_cache

    embed_bundle(session_dir, hf_model_dir("qwen3"), "qwen3_embed_mean", "mean")  # the cache
    out = tmp_path / "verified"
    manifest = str(session_dir / "qwen3_embed_mean.yaml")
    run_cli(
        "build", manifest, "-o", str(out), "--cache", str(artifact_cache()), "--verify", check=True
    )
    for g in json.loads((out / "bundle.json").read_text())["graphs"]:
        assert g["verify"]["ok"] and g["verify"]["max_logprob_error"] < 1e-3, g["name"]


def _inputs(graph: dict) -> list[str]:
    return [i["name"] for i in graph["inputs"]]


def test_tp2_embeddings_equal_hf(session_dir, hf_model_dir):
    model = hf_model_dir("qwen3")
    bundle = embed_bundle(session_dir, model, "qwen3_embed_mean_tp2", "mean", parallel={"tp": 2})
    prompts = [BATCH[2], BATCH[9], LONG]
    args = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    proc = run_cli("run", str(bundle), *args, "--json", check=True)
    outputs = json.loads(proc.stdout)["outputs"]
    assert [o["prompt_tokens"] for o in outputs] == [len(p) for p in prompts]
    assert_close([o["embedding"] for o in outputs], hf_embeddings(model, prompts, "mean"))


def test_a_base_model_checkpoint_without_an_lm_head_embeds_the_same(session_dir, hf_model_dir):
    """A `*Model` checkpoint, as embedding models ship (Qwen3-Embedding): names without
    `model.`, no LM head; read as the causal LM's names, its embeddings HF's."""
    from safetensors.torch import load_file, save_file

    model = hf_model_dir("qwen3")

    def strip(out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(model / name, out / name)
        weights = load_file(model / "model.safetensors")
        base = {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}
        save_file(base, out / "model.safetensors")

    base = cached_dir(f"{model_dir_name('qwen3')}-base", strip)
    bundle = embed_bundle(session_dir, base, "qwen3_base_embed_last", "last")
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    assert_close(LLM(load(bundle)).embed(BATCH[8:12]), hf_embeddings(model, BATCH, "last")[8:12])


@pytest.fixture(scope="module")
def embed_server(session_dir, hf_model_dir):
    bundle = embed_bundle(session_dir, hf_model_dir("qwen3"), "qwen3_embed_last", "last")
    srv = Server(bundle, "--served-model-name", "tiny-embed")
    yield srv
    srv.stop()


def test_server_embeddings_equal_hf_float_and_base64(embed_server, hf_model_dir):
    client = embed_server.client()
    want = hf_embeddings(hf_model_dir("qwen3"), BATCH, "last")
    as_float = client.embeddings.create(model="tiny-embed", input=BATCH, encoding_format="float")
    assert [d.index for d in as_float.data] == list(range(len(BATCH)))
    assert_close([d.embedding for d in as_float.data], want)
    assert as_float.usage.prompt_tokens == sum(LENGTHS)
    as_base64 = client.embeddings.create(model="tiny-embed", input=BATCH)  # the client's default
    assert_close([d.embedding for d in as_base64.data], want)
    one = client.embeddings.create(model="tiny-embed", input="Six sevens are forty-two.")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 64


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": ["a", 3]}, "input"),
        ({"input": [list(range(2, 80))]}, "prompt"),  # past the largest context bucket
        ({"input": [[1, 10**9]]}, "prompt"),  # outside the vocabulary
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 32}, "dimensions"),
    ],
)
def test_server_refuses_bad_embedding_bodies_by_name(embed_server, body, param):
    out = httpx.post(f"{embed_server.url}/v1/embeddings", json=body, timeout=30)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param, out.text


def test_an_embed_bundle_refuses_the_generating_routes(embed_server):
    client = embed_server.client()
    with pytest.raises(openai.BadRequestError, match="computes embeddings"):
        client.completions.create(model="tiny-embed", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="computes embeddings"):
        client.chat.completions.create(
            model="tiny-embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
