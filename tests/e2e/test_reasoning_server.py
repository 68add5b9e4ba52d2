"""`--reasoning-parser` on a real server: a tiny Qwen3 whose weights make greedy decoding walk a
fixed path (each token's only successor), `<think>Six sevens</think>Forty-two`, split into the
chat message's reasoning_content and content exactly, whole and streamed, through the openai
client."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.bundles import build_session_bundle
from tests.support.cache import cached_dir
from tests.support.models import CHAT_TEMPLATE, COMMON, DEMO_MODEL, LEAN_SAMPLING
from tests.support.server import Server

pytestmark = pytest.mark.xdist_group("reasoning")

REASONING, ANSWER = "Six sevens", "Forty-two"
OUTPUT = f"<think>{REASONING}</think>{ANSWER}"
MESSAGES = [{"role": "user", "content": "6 x 7?"}]
TOKENS_FILE = "path_tokens.json"  # beside the model: how many tokens its path generates


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _path_model(out: Path) -> int:
    """A Qwen3 whose layers add nothing (o_proj and down_proj zero), so the last hidden state
    is the current token's embedding, and whose LM head maps that to the token after it on
    the path: the chat prompt's last token, then OUTPUT's tokens. `<think>` and `</think>` are
    added tokens (not special: decoding keeps them), as in Qwen3's tokenizer. Returns the
    number of tokens to generate."""
    import tokenizers
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(out / "tokenizer.json"))
    shutil.copyfile(DEMO_MODEL / "tokenizer_config.json", out / "tokenizer_config.json")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    text = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), chat_template=CHAT_TEMPLATE
    ).apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False).ids
    path = [prompt[-1], *tok.encode(OUTPUT, add_special_tokens=False).ids]
    assert len(set(path)) == len(path), "a token with two successors"
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        **{**COMMON, "vocab_size": 1032, "head_dim": 32, "tie_word_embeddings": False}
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros_like(model.lm_head.weight)
        for here, after in zip(path, path[1:], strict=False):
            hidden = model.model.norm(model.model.embed_tokens.weight[here])
            head[after] = 10 * hidden / hidden.norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    return len(path) - 1


def _made_path_model(out: Path) -> None:
    """_path_model into `out`, in a process of its own: transformers saves nothing where
    torch.distributed says rank != 0, and a test worker may hold tracing's fake group
    (tests/support/models.py). The number of tokens to generate goes beside it."""
    code = (
        "import json, sys; from pathlib import Path\n"
        "from tests.e2e.test_reasoning_server import _path_model\n"
        "print(json.dumps(_path_model(Path(sys.argv[1]))))\n"
    )
    made = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True)
    assert made.returncode == 0, made.stderr.decode()[-3000:]
    (out / TOKENS_FILE).write_text(made.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reasoning_server(session_dir):
    # once per machine, renamed into place under a lock (concurrent workers and runs agree)
    recipe = inspect.getsource(_path_model) + OUTPUT + transformers_version()
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    model = cached_dir(f"models/qwen3_path-{digest}", _made_path_model)
    built = build_session_bundle(
        session_dir,
        model,
        "qwen3_path",
        buckets={"prefill": [16], "decode": [2], "context": [64]},
        sampling={**LEAN_SAMPLING, "structured": True},
    )
    srv = Server(built.bundle, "--served-model-name", "tiny", "--reasoning-parser", "qwen3")
    yield srv, json.loads((model / TOKENS_FILE).read_text())
    srv.stop()


def test_reasoning_and_content_split_whole_and_streamed(reasoning_server):
    server, tokens = reasoning_server
    client = server.client()
    args = dict(model="tiny", messages=MESSAGES, max_tokens=tokens, temperature=0)
    whole = client.chat.completions.create(**args).choices[0].message
    assert (whole.reasoning_content, whole.content) == (REASONING, ANSWER)
    reasoning = content = ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_stopped_inside_the_reasoning_it_is_all_reasoning(reasoning_server):
    server, _ = reasoning_server
    args = dict(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    message = server.client().chat.completions.create(**args).choices[0].message
    assert message.content is None and REASONING.startswith(message.reasoning_content)


CHOICE = {"structured_outputs": {"choice": ["yes", "no"]}}


def test_a_constraint_applies_after_the_reasoning_whole_and_streamed(reasoning_server):
    """vLLM's rule: the reasoning is the model's own (the path's `Six sevens`, which the choice
    would forbid), the answer after `</think>` one of the choices."""
    server, tokens = reasoning_server
    client = server.client()
    args = dict(
        model="tiny", messages=MESSAGES, max_tokens=tokens + 4, temperature=0, extra_body=CHOICE
    )
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.message.reasoning_content == REASONING
    assert whole.message.content in ("yes", "no") and whole.finish_reason == "stop"
    reasoning = content = ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (REASONING, whole.message.content)


def test_a_prompt_that_ended_the_reasoning_is_constrained_from_the_first_token(reasoning_server):
    server, _ = reasoning_server
    messages = [{"role": "user", "content": "<think>no need</think>6 x 7?"}]
    message = (
        server.client()
        .chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=CHOICE
        )
        .choices[0]
        .message
    )
    assert message.reasoning_content is None and message.content in ("yes", "no")


def test_a_response_carries_the_reasoning_as_its_own_item(reasoning_server):
    server, tokens = reasoning_server
    done = server.client().responses.create(
        model="tiny", input=MESSAGES[0]["content"], max_output_tokens=tokens, temperature=0
    )
    reasoning, message = done.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and done.output_text == ANSWER
