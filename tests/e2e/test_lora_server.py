"""LoRA adapters through the OpenAI-compatible server, as vLLM serves them: a real `neffkit run`
process with `--lora-modules`, driven by the real `openai` client and httpx. A request's `model`
picks the base or an adapter, token for token as HF + peft (the `oracle` fixture); adapters are
listed in /v1/models, loaded and unloaded at run time (with NEFFKIT_ALLOW_RUNTIME_LORA_UPDATING),
and counted in /metrics."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.adapters import PROMPTS
from tests.support.cli import run_cli
from tests.support.models import LONG, MAX_NEW
from tests.support.server import Server, _free_port

# one worker runs this module, so its tests share its servers (pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("lora_server")

KEY = "lora-key"
ENV = "NEFFKIT_ALLOW_RUNTIME_LORA_UPDATING"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def lora_server(lora_bundle: Path, adapters: dict[str, Path]) -> Iterator[Server]:
    """attn4 and all8 after one flag (vLLM's form), runtime updating on, behind an API key."""
    srv = Server(
        lora_bundle,
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
        "--public-metrics",
        "--lora-modules",
        f"attn4={adapters['attn4']}",
        f"all8={adapters['all8']}",
        env={**os.environ, ENV: "1"},
    )
    yield srv
    srv.stop()


def _post(srv: Server, path: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=120)


def _complete(srv: Server, model: str, prompt: list[int]) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "return_token_ids": True,
    }
    return _post(srv, "/v1/completions", body)


def _all_at_once(srv: Server, jobs: list[tuple[list[int], str]]) -> list[list[int]]:
    """Every (prompt, model) sent at once through the async openai client: the token ids."""

    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY)

        async def one(prompt: list[int], model: str) -> list[int]:
            out = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_NEW,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            assert out.model == model  # an adapter's name echoed, as vLLM does
            return (out.choices[0].model_extra or {})["token_ids"]

        return await asyncio.gather(*(one(p, m) for p, m in jobs))

    return asyncio.run(run())


def _want(oracle: dict, model: str, prompt: list[int]) -> list[int]:
    return oracle[None if model == "tiny" else model][PROMPTS.index(prompt)]


def _counter(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's series whose labels include `labels`."""
    total = 0.0
    for found, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found))
        total += float(value) if all(have.get(k) == v for k, v in labels.items()) else 0.0
    return total


def _lora_info(text: str) -> list[dict[str, str]]:
    """vllm:lora_requests_info's series, by their labels."""
    pattern = r"^vllm:lora_requests_info{([^}]*)} (\S+)$"
    return [dict(re.findall(r'(\w+)="([^"]*)"', m)) for m, _ in re.findall(pattern, text, re.M)]


def test_mixed_concurrent_requests_equal_hf_peft(lora_server: Server, oracle) -> None:
    """The base and both adapters at once (two slots, n-gram speculation on): every request's
    tokens equal HF + peft's for its adapter; streamed and chat requests name theirs too; the
    metrics count each adapter's requests and show which ran."""
    before = lora_server.metrics()
    jobs = [(p, m) for m in ("tiny", "attn4", "all8") for p in PROMPTS]
    for (prompt, model), got in zip(jobs, _all_at_once(lora_server, jobs), strict=True):
        assert got == _want(oracle, model, prompt), (model, prompt)

    client = lora_server.client(api_key=KEY)
    stream = client.completions.create(
        model="all8",
        prompt=LONG,
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"all8"}
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed == _want(oracle, "all8", LONG)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="attn4", messages=messages, max_tokens=4)
    assert chat.model == "attn4" and chat.usage.completion_tokens == 4

    after = lora_server.metrics()
    counts = {
        name: _counter(after, "neffkit:lora_requests_total", lora_name=name)
        - _counter(before, "neffkit:lora_requests_total", lora_name=name)
        for name in ("attn4", "all8")
    }
    assert counts == {"attn4": len(PROMPTS) + 1, "all8": len(PROMPTS) + 1}
    info = _lora_info(after)
    assert info and all(s["max_lora"] == "2" and s["model_name"] == "tiny" for s in info)
    ran = {name for s in info for name in s["running_lora_adapters"].split(",") if name}
    assert ran == {"attn4", "all8"}
    assert all("waiting_lora_adapters" in s for s in info)


def test_models_lists_the_adapters(lora_server: Server, adapters: dict[str, Path]) -> None:
    listed = lora_server.client(api_key=KEY).models.list()
    assert [m.id for m in listed.data][:3] == ["tiny", "attn4", "all8"]
    cards = {
        c["id"]: c for c in httpx.get(f"{lora_server.url}/v1/models", headers=AUTH).json()["data"]
    }
    assert "parent" not in cards["tiny"] and cards["tiny"]["max_model_len"] == 64
    for name in ("attn4", "all8"):
        card = cards[name]
        assert (card["object"], card["owned_by"], card["parent"]) == ("model", "neffkit", "tiny")
        assert card["root"] == str(adapters[name]) and card["max_model_len"] == 64


def test_an_unknown_model_is_a_404(lora_server: Server) -> None:
    resp = _complete(lora_server, "nope", [5, 6, 7])
    assert resp.status_code == 404
    assert resp.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    assert _post(lora_server, "/v1/chat/completions", chat).status_code == 404
    with pytest.raises(openai.NotFoundError):
        lora_server.client(api_key=KEY).completions.create(model="x" * 5000, prompt=[5])


def test_load_and_unload_at_run_time(lora_server: Server, adapters: dict[str, Path], oracle):
    srv = lora_server
    load = {"lora_name": "mlp16", "lora_path": str(adapters["mlp16"])}
    assert _post(srv, "/v1/load_lora_adapter", load, key=None).status_code == 401
    resp = _post(srv, "/v1/load_lora_adapter", load)
    assert resp.status_code == 200 and "mlp16" in resp.text, resp.text
    jobs = [(p, "mlp16") for p in PROMPTS] + [(p, "attn4") for p in PROMPTS]
    for (prompt, model), got in zip(jobs, _all_at_once(srv, jobs), strict=True):
        assert got == _want(oracle, model, prompt), (model, prompt)

    again = _post(srv, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    wide = _post(
        srv, "/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(adapters["wide32"])}
    )
    assert wide.status_code == 400
    assert "r 32 is above this bundle's lora.max_rank 16" in wide.json()["error"]["message"]
    bad = [
        ({"lora_path": str(adapters["attn4"])}, "lora_name"),
        ({"lora_name": 5, "lora_path": str(adapters["attn4"])}, "lora_name"),
        ({"lora_name": "a b", "lora_path": str(adapters["attn4"])}, "lora_name"),
        ({"lora_name": "x" * 129, "lora_path": str(adapters["attn4"])}, "lora_name"),
        ({"lora_name": "tiny", "lora_path": str(adapters["attn4"])}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": ["/"]}, "lora_path"),
        ({"lora_name": "x", "lora_path": "/nowhere/at/all"}, "lora_path"),
        (
            {"lora_name": "x", "lora_path": str(adapters["attn4"] / "adapter_config.json")},
            "lora_path",
        ),
        ({"lora_name": "x", "lora_path": "/tmp\x00"}, "lora_path"),
    ]
    for body, param in bad:
        resp = _post(srv, "/v1/load_lora_adapter", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)
    ids = _model_ids(srv)
    assert "mlp16" in ids and "w" not in ids and "x" not in ids

    resp = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "mlp16"})
    assert resp.status_code == 200, resp.text
    assert _complete(srv, "mlp16", [5, 6, 7]).status_code == 404
    assert "mlp16" not in _model_ids(srv)
    for name in ("mlp16", "nope"):
        gone = _post(srv, "/v1/unload_lora_adapter", {"lora_name": name})
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert _post(srv, "/v1/unload_lora_adapter", {}).json()["error"]["param"] == "lora_name"


def _model_ids(srv: Server) -> list[str]:
    return [m.id for m in srv.client(api_key=KEY).models.list().data]


def _core_pid(srv: Server) -> int:
    """The engine core: the server's child process started by multiprocessing's spawn."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == srv.proc.pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError("no engine core process")


def test_unloading_lets_sent_requests_finish(lora_server: Server, adapters, oracle) -> None:
    """With the engine frozen, a request for an adapter is sent, then the adapter unloaded: the
    request still runs with it, while a new request for it is a 404 at once."""
    srv = lora_server
    assert (
        _post(
            srv, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["mlp16"])}
        ).status_code
        == 200
    )
    core = _core_pid(srv)
    results: dict[str, httpx.Response] = {}

    def send(key: str, call) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(key, call()))
        thread.start()
        return thread

    os.kill(core, signal.SIGSTOP)
    try:
        running = send("request", lambda: _complete(srv, "late", LONG))
        deadline = time.monotonic() + 30
        while not _counter(srv.metrics(), "neffkit:lora_requests_total", lora_name="late"):
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.05)
        unload = send(
            "unload", lambda: _post(srv, "/v1/unload_lora_adapter", {"lora_name": "late"})
        )
        while "late" in _model_ids(srv):  # (a request for it now would wait on the engine)
            assert time.monotonic() < deadline, "the adapter was never unloaded"
            time.sleep(0.05)
        assert _complete(srv, "late", [5, 6]).status_code == 404
    finally:
        os.kill(core, signal.SIGCONT)
    running.join(timeout=60)
    unload.join(timeout=60)
    assert results["unload"].status_code == 200
    choice = results["request"].json()["choices"][0]
    assert choice["token_ids"] == _want(oracle, "mlp16", LONG)


def test_without_the_env_var_there_are_no_adapter_routes(lora_bundle, adapters) -> None:
    """Repeated flags and vLLM's JSON form (its base_model_name is the `parent`)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    spec = f'{{"name": "all8", "path": "{adapters["all8"]}", "base_model_name": "base"}}'
    srv = Server(
        lora_bundle,
        "--lora-modules",
        f"attn4={adapters['attn4']}",
        "--lora-modules",
        spec,
        "--max-cpu-loras",
        "3",
        env=env,
    )
    try:
        cards = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert [(c["id"], c.get("parent")) for c in cards][1:] == [
            ("attn4", cards[0]["id"]),
            ("all8", "base"),
        ]
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            body = {"lora_name": "mlp16", "lora_path": str(adapters["mlp16"])}
            resp = httpx.post(f"{srv.url}/v1/{route}", json=body)
            assert resp.status_code == 404, resp.text
        assert _complete(srv, "attn4", [5, 6, 7]).status_code == 200
    finally:
        srv.stop()


def test_a_bad_adapter_stops_the_server_from_starting(lora_bundle, adapters, bundle) -> None:
    port = str(_free_port())
    cases = [
        (lora_bundle, f"x={adapters['attn4'].parent / 'nowhere'}", "not a directory"),
        (lora_bundle, f"w={adapters['wide32']}", "r 32 is above this bundle's lora.max_rank 16"),
        (bundle("llama"), f"x={adapters['attn4']}", "built without adapter slots"),
        (lora_bundle, "no-path", "expected NAME=PATH or a JSON object"),
        (lora_bundle, f"tiny bit={adapters['attn4']}", "is not an adapter name"),
    ]
    for served, module, message in cases:
        proc = run_cli("run", str(served), "--port", port, "--lora-modules", module, timeout=120)
        assert proc.returncode == 2, (module, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
