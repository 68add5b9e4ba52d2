"""The runtime tokenizer against HF transformers (the oracle): prompt ids and chat prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from neffkit.errors import RequestError
from neffkit.runtime.tokenizer import Tokenizer
from tests.support.models import DEMO_MODEL

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
STRICT = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}"
)


def _tokenizer_dir(tmp_path: Path, name: str, bos_post_processor: bool) -> Path:
    out = tmp_path / name
    out.mkdir()
    config = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    spec = json.loads((DEMO_MODEL / "tokenizer.json").read_text())
    if bos_post_processor:  # Llama 3's form: the post-processor puts BOS first
        config["bos_token"] = "<|endoftext|>"
        bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
        seq = {"Sequence": {"id": "A", "type_id": 0}}
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [bos, seq],
            "pair": [bos, seq, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {
                "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
            },
        }
    (out / "tokenizer.json").write_text(json.dumps(spec))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos-post-processor"])
def test_prompt_ids_equal_hf_autotokenizer(tmp_path, bos) -> None:
    import transformers

    path = _tokenizer_dir(tmp_path, "tok", bos)
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for text in ["def main(", "  x = 'é' 🙂\n", ""]:
        assert ours.encode(text) == hf(text).input_ids, text
    assert (ours.encode("x")[0] == 0) is bos


def test_chat_uses_the_bundle_template_with_real_special_tokens(tmp_path) -> None:
    import transformers

    path = _tokenizer_dir(tmp_path, "chat", bos_post_processor=True)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == want
    assert want.startswith("<|endoftext|>[system] be brief<|endoftext|>")
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode_chat(messages) == list(ids)


def test_a_template_that_refuses_is_a_request_error(tmp_path) -> None:
    path = tmp_path / "strict"
    shutil.copytree(DEMO_MODEL, path, ignore=shutil.ignore_patterns("*.safetensors"))
    (path / "chat_template.jinja").write_text(STRICT)
    tok = Tokenizer.from_dir(path)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(RequestError) as err:
        tok.render_chat([{"role": "system", "content": "x"}])
    assert err.value.param == "messages" and "no system messages" in err.value.message
