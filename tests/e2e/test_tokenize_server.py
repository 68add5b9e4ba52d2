"""`/tokenize` and `/detokenize` on a real server, driven by raw httpx, against transformers'
tokenizer of the same checkpoint (its ids for a text, and for its chat template's output)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.xdist_group("tokenize")

TEXT = "def main():\n    return 42  # the answer"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 6 x 7?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(hf_model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(hf_model_dir("llama"))


def _post(server: Server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=30)


def test_tokenize_counts_equal_transformers_on_text_and_chat(server, hf_tokenizer):
    out = _post(server, "/tokenize", {"prompt": TEXT}).json()
    want = hf_tokenizer(TEXT)["input_ids"]
    assert out == {"count": len(want), "max_model_len": 64, "tokens": want, "token_strs": None}
    bare = _post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for generation in (True, False):
        body = {"messages": MESSAGES, "add_generation_prompt": generation}
        chat = _post(server, "/tokenize", body).json()
        template = hf_tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=generation
        )
        assert chat["tokens"] == hf_tokenizer(template, add_special_tokens=False)["input_ids"]
        assert chat["count"] == len(chat["tokens"])
    strs = _post(server, "/tokenize", {"prompt": "six by seven", "return_token_strs": True})
    assert "".join(strs.json()["token_strs"]).strip() == "six by seven"


def test_detokenize_is_the_tokenizers_decode(server, hf_tokenizer):
    ids = hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    out = _post(server, "/detokenize", {"tokens": ids, "model": "tiny"})
    assert out.status_code == 200
    assert out.json() == {"prompt": hf_tokenizer.decode(ids, skip_special_tokens=True)}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/detokenize", {"tokens": [5, 1024]}, "tokens"),  # the vocabulary is 1024
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "5 6"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "tools": "none"}, "tools"),
        ("/tokenize", {"prompt": "a", "model": 3}, "model"),
    ],
)
def test_bad_tokenize_requests_are_400s_naming_the_field(server, route, body, param):
    out = _post(server, route, body)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param


def test_an_unknown_model_is_a_404(server):
    for route, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        assert _post(server, route, {**body, "model": "other"}).status_code == 404


def test_a_generate_bundle_refuses_embeddings_by_name(server):
    with pytest.raises(openai.BadRequestError, match="computes no embeddings") as refused:
        server.client().embeddings.create(model="tiny", input="hi")
    assert refused.value.body["param"] == "model"
