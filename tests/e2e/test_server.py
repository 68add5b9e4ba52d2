"""The OpenAI-compatible server: a real `neffkit run` process driven by the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.support.cli import run_cli, run_json
from tests.support.server import Server

# one worker runs this module, so its tests share one server (pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("server")


def _offline(bundle: Path, prompt: str, max_tokens: int) -> str:
    out = run_cli(
        "run",
        str(bundle),
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        "--json",
        check=True,
    ).stdout
    return json.loads(out)["outputs"][0]["text"]


def test_completion_and_chat_match_offline_run(server: Server, serve_bundle: Path) -> None:
    client = server.client()
    prompt = "def main():\n    return"
    want = _offline(serve_bundle, prompt, 10)
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert done.choices[0].text == want
    assert done.usage.completion_tokens == 10 and done.usage.prompt_tokens > 0
    streamed = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text


def test_models_health_version(server: Server, serve_bundle: Path) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    version = httpx.get(f"{server.url}/version").json()
    assert (
        version["bundle_digest"]
        == __import__("hashlib").sha256((serve_bundle / "bundle.json").read_bytes()).hexdigest()
    )


def test_sixteen_concurrent_streams_equal_single_outputs(server: Server) -> None:
    prompts = [list(range(3 + i, 10 + 2 * i)) for i in range(16)]
    client = server.client()

    def single(prompt: list[int]) -> str:
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    alone = [single(p) for p in prompts]

    async def stream_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")

        async def one(prompt: list[int]) -> str:
            chunks = await aclient.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))

    before = _counter(server.metrics(), "vllm:request_success_total")
    together = asyncio.run(stream_all())
    assert together == alone
    metrics = server.metrics()
    assert _counter(metrics, "vllm:request_success_total") - before == 16
    assert "vllm:time_to_first_token_seconds_count" in metrics
    assert "vllm:inter_token_latency_seconds_bucket" in metrics
    assert _gauge(metrics, "vllm:kv_cache_usage_perc") == 0.0


def _counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def _gauge(text: str, name: str) -> float:
    return _counter(text, name)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"{not json", None, "not valid JSON"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens", "must be int"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens", "must be >= 0"),
        ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature", "number"),
        ({"model": "tiny", "prompt": 5}, "prompt", "prompt must be"),
        ({"model": "tiny", "prompt": list(range(1, 70))}, "prompt", "context buckets: [64]"),
        ({"model": "tiny", "prompt": "hi", "stop": 3}, "stop", "stop must be"),
        ({"model": "tiny", "prompt": "hi", "priority": 1}, "priority", "first come, first"),
        ({"model": "tiny", "prompt": "hi", "priority": 1.5}, "priority", "must be int"),
    ],
)
def test_bad_requests_get_400(server: Server, body, param, fragment) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_an_unknown_model_gets_vllms_404(server: Server) -> None:
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert resp.status_code == 404
    assert resp.json()["error"] == {
        "message": "The model `gpt-9` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_chat_bad_messages_get_400(server: Server) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_disconnecting_clients_free_their_kv_blocks(server: Server) -> None:
    async def leave_early(i: int) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {
                "model": "tiny",
                "prompt": [5 + i, 6, 7],
                "max_tokens": 40,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        return  # first token seen: hang up mid-stream

    async def fifty() -> None:
        await asyncio.gather(*(leave_early(i) for i in range(50)))

    asyncio.run(fifty())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if (
            _gauge(metrics, "vllm:kv_cache_usage_perc") == 0.0
            and _gauge(metrics, "vllm:num_requests_running") == 0.0
        ):
            break
        time.sleep(0.2)
    assert _gauge(metrics, "vllm:kv_cache_usage_perc") == 0.0
    assert _counter(metrics, "vllm:request_success_total") > 0
    assert 'finished_reason="abort"' in metrics


def test_api_key_is_required_when_set(serve_bundle: Path) -> None:
    srv = Server(serve_bundle, "--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        assert srv.client(api_key="s3cret").models.list().data
        assert httpx.get(f"{srv.url}/health").status_code == 200  # health needs no key
    finally:
        srv.stop()


def test_server_binds_localhost_by_default(server: Server) -> None:
    """The listening socket's local address, as the kernel reports it (/proc/net/tcp)."""
    listening = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, port = local.split(":")
        if state == "0A" and int(port, 16) == server.port:  # 0A: LISTEN
            listening.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    assert listening == ["127.0.0.1"]


def test_tp2_bundle_serves_from_rank0(tp_bundle) -> None:
    """With tp > 1 the engine core is rank 0 and starts the other rank, as offline runs do."""
    bundle = tp_bundle("llama").bundle
    prompt = [7, 8, 9, 10, 11]
    offline = run_cli(
        "run",
        str(bundle),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
        check=True,
    ).stdout
    want = json.loads(offline)["outputs"][0]["text"]
    srv = Server(bundle)
    try:
        model = srv.client().models.list().data[0].id
        out = srv.client().completions.create(
            model=model,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == want
    finally:
        srv.stop()


# ---------------------------------------------------------------- fuzzing

FUZZ_FIELDS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "n",
    "ignore_eos",
    "logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "json_schema",
    "schema",
    "regex",
    "choice",
    "grammar",
    "function",
    "name",
    "parameters",
)


def _json_values():
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=6)
        | st.sampled_from(["tiny", "def main(", "\n"])
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(FUZZ_FIELDS + ("role", "content", "type", "text")),
                inner,
                max_size=3,
            )
        ),
        max_leaves=8,
    )


def _bodies():
    from hypothesis import strategies as st

    token_ids = st.lists(st.integers(min_value=-3, max_value=1100), min_size=0, max_size=5)
    plausible = st.fixed_dictionaries(
        {"model": st.just("tiny"), "max_tokens": st.integers(min_value=-1, max_value=3)},
        optional={
            "prompt": st.text(max_size=8) | token_ids,
            "temperature": st.sampled_from([0, 0.5, 1.0]),
            "stream": st.booleans(),
            "seed": st.integers(min_value=0, max_value=2**33),
            "stop": st.sampled_from(["\n", ["a", "b"]]),
        },
    )
    hostile = st.dictionaries(st.sampled_from(FUZZ_FIELDS), _json_values(), max_size=6)
    return st.tuples(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        st.one_of(st.builds(lambda a, b: {**a, **b}, plausible, hostile), hostile),
        st.integers(min_value=0, max_value=30),  # truncate the JSON this often (0 = never)
    )


def test_fuzzed_requests_never_hurt_the_server(server: Server) -> None:
    """Generated bodies (wrong types, nulls, huge numbers, NaN, truncated JSON): no 5xx, an
    OpenAI error body on every 4xx, and the engine alive with the same greedy answer after."""
    from hypothesis import HealthCheck, given, settings

    def greedy() -> str:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
        return httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"]

    before = greedy()

    @settings(
        max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(_bodies())
    def check(case) -> None:
        path, body, cut = case
        raw = json.dumps(body).encode()
        if cut == 1:
            raw = raw[: len(raw) // 2]
        with httpx.stream(
            "POST",
            server.url + path,
            content=raw,
            timeout=60,
            headers={"content-type": "application/json"},
        ) as resp:
            resp.read()
            assert resp.status_code < 500, (body, resp.text)
            if resp.status_code >= 400:
                error = resp.json()["error"]
                assert {"message", "type", "param", "code"} <= set(error), resp.text

    check()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert greedy() == before


def test_out_of_vocabulary_ids_get_400_and_the_server_keeps_serving(server: Server) -> None:
    for prompt in ([1, 99999], [-1, 5]):
        resp = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
        assert "outside the vocabulary" in resp.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    out = server.client().completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0
    )
    assert out.usage.completion_tokens == 3


# ---------------------------------------------------------------- a dead engine


def _children(pid: int, marker: str) -> list[int]:
    """Child processes of `pid` whose command line contains `marker`."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[1]) == pid and marker in cmdline:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _post_in_background(url: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []

    def post() -> None:
        result.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, result


def _wait_submitted(srv: Server, count: int = 1) -> None:
    deadline = time.monotonic() + 30
    while _counter(srv.metrics(), "vllm:prompt_tokens_total") < count:
        assert time.monotonic() < deadline, "the request never reached the engine client"
        time.sleep(0.05)


def test_a_dead_engine_fails_requests_and_stops_the_server(serve_bundle: Path, tmp_path) -> None:
    """Kill the engine core with a request in flight: that request gets a 500 naming the cause,
    the server logs it and exits 1 (a supervisor restarts it), and nothing is left running.
    The server has a temp dir of its own, which no other test's process sweeps."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    srv = Server(serve_bundle, "--served-model-name", "tiny", env=env)
    try:
        (core,) = _children(srv.proc.pid, "spawn_main")  # not the resource tracker
        os.kill(core, signal.SIGSTOP)  # frozen: the next request is in flight for certain
        thread, result = _post_in_background(
            srv.url, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8}
        )
        _wait_submitted(srv)
        os.kill(core, signal.SIGKILL)
        thread.join(timeout=60)
        resp = result[0]
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["type"] == "engine_error" and "the engine process exited" in error["message"]
        assert srv.proc.wait(timeout=60) == 1
        assert "the engine failed" in srv.stderr()
        assert not _alive(core)
        # the killed core could not remove its unpacked packages; the next process that loads
        # a bundle does
        left = f"neffkit-aoti-{core}-*"
        assert list((tmp_path / "tmp").glob(left))
        again = run_cli(
            "run", str(serve_bundle), "--prompt-ids", "5,6", "--max-tokens", "1", env=env
        )
        assert again.returncode == 0, again.stderr
        assert not list((tmp_path / "tmp").glob(left))
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def test_a_dead_follower_rank_stops_the_tp2_server(tp_bundle) -> None:
    srv = Server(tp_bundle("llama").bundle, "--served-model-name", "tiny", "--dist-timeout", "20")
    try:
        (core,) = _children(srv.proc.pid, "spawn_main")
        (follower,) = _children(core, "neffkit.runtime.worker.follower")
        os.kill(follower, signal.SIGKILL)
        thread, result = _post_in_background(
            srv.url, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8}
        )
        thread.join(timeout=90)
        resp = result[0]
        assert resp.status_code == 500 and "lost contact" in resp.json()["error"]["message"]
        assert srv.proc.wait(timeout=60) == 1
        assert not _alive(core) and not _alive(follower)
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def test_stop_strings_cut_the_answer_right_before_them(server: Server) -> None:
    """Any stop string taken from a greedy completion: the answer is that completion cut right
    before the stop's first occurrence, plain and streamed alike."""
    client = server.client()
    base = dict(
        model="tiny",
        prompt="def main(",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**base).choices[0].text
    assert len(full) > 12
    stops = {full[i : i + n] for i in (1, len(full) // 3, len(full) // 2) for n in (1, 2, 4)}
    stops |= {full[-3:], "\n\n", "never-in-there"}
    for stop in sorted(stops):
        want = full.split(stop, 1)[0]
        plain = client.completions.create(**base, stop=[stop]).choices[0]
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(**base, stop=[stop], stream=True)
            if c.choices
        )
        assert plain.text == want == streamed, repr(stop)
        assert plain.finish_reason == ("stop" if stop in full else "length")
        kept = (
            client.completions.create(
                **{**base, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                stop=[stop],
            )
            .choices[0]
            .text
        )
        assert kept == (want + stop if stop in full else full)


def test_chat_renders_the_bundle_chat_template(server: Server, serve_bundle: Path) -> None:
    """The bundle's chat_template.jinja (not neffkit's default) with the real eos_token; the
    prompt ids equal HF's apply_chat_template, so the answer equals the completion of them."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(serve_bundle / "tokenizer")
    messages = [{"role": "user", "content": "def main("}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("### user: def main(<|endoftext|>")
    ids = hf(text, add_special_tokens=False).input_ids
    client = server.client()
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    assert chat.usage.prompt_tokens == len(ids)
    same = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text


def test_a_list_of_prompts_and_n_choices(server: Server) -> None:
    client = server.client()
    prompts = ["def main(", [5, 6, 7]]
    each = [
        client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    both = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == each
    assert both.usage.completion_tokens == 10
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model="tiny", prompt=prompts, max_tokens=5, temperature=0, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[0], streamed[1]] == each
    sampled = dict(model="tiny", prompt="def main(", max_tokens=8, temperature=1.5, n=3, seed=11)
    out, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded
    assert len({c.text for c in out.choices}) > 1  # distinct seeds per sample
    assert out.usage.completion_tokens == 24


def _hf_log_softmax(model_dir: Path, ids: list[int]):
    """HF's float32 log-softmax after each prefix of `ids`: [len(ids), vocab]."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_equal_hf_log_softmax(server: Server, hf_model_dir) -> None:
    """Echoed prompt tokens' and generated tokens' logprobs (and the top alternatives) equal
    HF's log_softmax within 1e-3: a prompt longer than the prefill bucket (two chunks), and
    lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 0)."""
    prompt = list(range(5, 28))  # 23 tokens: chunks of 16 and 7
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 3,
        "echo": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }  # several ids can share a text
    choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    lp, ids = choice["logprobs"], prompt + choice["token_ids"]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 6
    assert len(lp["token_logprobs"]) == len(ids) == len(lp["tokens"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _hf_log_softmax(hf_model_dir("llama"), ids)
    for i in range(1, len(ids)):  # token i, scored after ids[:i]
        assert abs(lp["token_logprobs"][i] - want[i - 1, ids[i]].item()) < 1e-3, i
        ranked = sorted(lp["top_logprobs"][i].items(), key=lambda kv: -kv[1])[:3]
        best = want[i - 1].topk(3)
        assert [int(k.removeprefix("token_id:")) for k, _ in ranked] == best.indices.tolist()
        assert np.allclose([v for _, v in ranked], best.values.tolist(), atol=1e-3), i
    for i in range(len(prompt), len(ids)):  # greedy: the first top logprob, exactly
        assert lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False}).json()
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][len(prompt) :]
    assert choice["text"].endswith(plain["choices"][0]["text"])
    client = server.client()  # lm-eval's loglikelihood request, through the openai client
    only = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert only.usage.completion_tokens == 0 and only.choices[0].finish_reason == "length"
    got = only.choices[0].logprobs.token_logprobs
    assert got == lp["token_logprobs"][: len(prompt)]
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True
    )
    assert [v for c in streamed if c.choices for v in c.choices[0].logprobs.token_logprobs] == got


def test_sampled_tokens_logprobs_equal_hf(server: Server, hf_model_dir) -> None:
    """Sampled (not greedy) tokens: each logprob is HF's log_softmax of the raw logits (before
    temperature) at its position, in completions and in chat (logprobs + top_logprobs)."""
    prompt = [3, 17, 29, 41]
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.3,
        "seed": 5,
        "logprobs": 2,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    ids = choice["token_ids"]
    want = _hf_log_softmax(hf_model_dir("llama"), prompt + ids)
    for i, token in enumerate(ids):
        assert (
            abs(choice["logprobs"]["token_logprobs"][i] - want[len(prompt) - 1 + i, token]) < 1e-3
        )
    messages = [{"role": "user", "content": "def main("}]
    chat = server.client().chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert all(len(c.top_logprobs) == 2 and c.logprob == c.top_logprobs[0].logprob for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 6})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"


def test_prefix_cache_hits_in_usage_and_metrics(server: Server, serve_bundle: Path) -> None:
    """A shared prefix: the second request reports its cached tokens (OpenAI's
    usage.prompt_tokens_details.cached_tokens) and generates what an uncached run does; the
    server counts queries and hits in tokens, as vLLM names them."""
    client = server.client()
    before = server.metrics()
    prefix = list(range(500, 540))  # 40 tokens: 2 full blocks of 16, in no other test
    first = client.completions.create(
        model="tiny", prompt=prefix + [7], max_tokens=4, temperature=0
    )
    second = client.completions.create(
        model="tiny", prompt=prefix + [8, 9], max_tokens=4, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    alone = run_json(
        "run",
        str(serve_bundle),
        "--max-tokens",
        "4",
        "--prompt-ids",
        ",".join(map(str, prefix + [8, 9])),
    )["outputs"][0]
    assert second.choices[0].text == alone["text"]
    after = server.metrics()
    queries = _counter(after, "vllm:prefix_cache_queries_total")
    hits = _counter(after, "vllm:prefix_cache_hits_total")
    assert queries - _counter(before, "vllm:prefix_cache_queries_total") == 41 + 42
    assert hits - _counter(before, "vllm:prefix_cache_hits_total") == 32
    chat = [{"role": "system", "content": "Be terse. Be terse."}, {"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny", messages=chat, max_tokens=2)
    again = client.chat.completions.create(model="tiny", messages=chat, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


# ---------------------------------------------------------------- what operators expect


def _wait_for(read, pattern: str, timeout: float = 10) -> re.Match:
    """The first match of `pattern` in what `read()` returns, once it appears."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, read(), re.M)):
        assert time.monotonic() < deadline, f"{pattern!r} never appeared in:\n{read()}"
        time.sleep(0.1)
    return found


def test_every_request_gets_an_access_log_line_and_a_request_id(server: Server) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    sent = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": "access-test-1"}
    )
    assert sent.status_code == 200 and sent.headers["x-request-id"] == "access-test-1"
    _wait_for(
        server.stdout,
        r"^127\.0\.0\.1:\d+ POST /v1/completions 200 \d+\.\dms "
        r"request_id=access-test-1$",
    )
    made = httpx.get(f"{server.url}/v1/models")  # no id sent: the server makes one
    rid = made.headers["x-request-id"]
    assert re.fullmatch(r"req-[0-9a-f]{16}", rid)
    _wait_for(server.stdout, rf"^127\.0\.0\.1:\d+ GET /v1/models 200 \d+\.\dms request_id={rid}$")


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/v1/nope", 404, "GET /v1/nope: no such endpoint; this server has GET /health, "),
        (
            "GET",
            "/v1/completions",
            405,
            "GET /v1/completions: method not allowed; this endpoint takes POST",
        ),
    ],
)
def test_404_and_405_answer_in_the_openai_error_shape(server, method, path, status, message):
    resp = httpx.request(method, f"{server.url}{path}")
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["message"].startswith(message), error
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, status)


def test_unknown_request_fields_are_logged_once_as_ignored(server: Server) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "frobnicate": 1}
    for i in range(2):
        resp = httpx.post(
            f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": f"unknown-{i}"}
        )
        assert resp.status_code == 200, resp.text
    _wait_for(server.stdout, r"request_id=unknown-1$")  # both requests answered and logged
    said = re.findall(r"^.*frobnicate.*$", server.stderr(), re.M)
    assert said == [
        "neffkit: request unknown-0: the following fields were present in the request but "
        "ignored: frobnicate (each field is logged once)"
    ]


def test_strict_requests_refuse_unknown_fields_and_no_access_log_is_quiet(serve_bundle) -> None:
    srv = Server(
        serve_bundle, "--served-model-name", "tiny", "--strict-requests", "--no-access-log"
    )
    try:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        resp = httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "frobnicate": 1})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "frobnicate"
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
        with pytest.raises(openai.BadRequestError) as err:
            srv.client().completions.create(**body, extra_body={"frobnicate": 1, "zork": 2})
        assert err.value.body["message"].startswith(
            "frobnicate is not a field this server knows (--strict-requests refuses unknown "
            "fields; unknown here: frobnicate, zork)"
        )
        assert srv.client().completions.create(**body).choices[0].finish_reason == "length"
        assert httpx.post(f"{srv.url}/v1/chat/completions", json=chat).status_code == 200
        assert srv.stdout().splitlines() == [f"neffkit: serving 'tiny' at {srv.url}/v1"]
        assert "frobnicate" not in srv.stderr()  # refused, not logged as ignored
    finally:
        srv.stop()


def test_a_port_in_use_is_refused_before_the_engine_loads(serve_bundle: Path) -> None:
    """The port is bound first: the error names it, nothing says it is serving, and no engine
    was started for nothing."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = run_cli("run", str(serve_bundle), "--port", str(port), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--port {port}: cannot listen there (Address already in use)" in proc.stderr
    assert "serving" not in proc.stdout


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_that_does_not_compile_is_blamed_on_tools(server: Server, choice) -> None:
    broken = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": broken}}]
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            tools=tools,
            tool_choice=choice,
            max_tokens=4,
        )
    assert err.value.body["param"] == "tools" and err.value.body["message"].startswith("tools: ")


def test_a_role_that_is_no_chat_role_is_refused_naming_the_roles(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(
            model="tiny", messages=[{"role": "wizard", "content": "hi"}], max_tokens=2
        )
    message = err.value.body["message"]
    assert err.value.body["param"] == "messages" and "messages[0].role: 'wizard'" in message
    assert "system, developer, user, assistant, tool" in message
