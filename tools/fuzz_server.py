"""Fuzz a running (or freshly started) `neffkit run` server with generated requests.

Bodies mix plausible values (short prompts, small max_tokens, in- and out-of-vocabulary token ids,
penalties, logit biases, JSON schemas, regexes, choices and grammars that compile or do not, tools
and tool choices) with hostile ones (wrong types, nulls, huge numbers, NaN, nested junk,
truncated JSON), for both /v1/completions and /v1/chat/completions, streamed and not. The server
must answer every one with a status below 500 and an OpenAI error body on every 4xx, keep
/health at 200, and give the same greedy answer before and after.

    python tools/fuzz_server.py BUNDLE --requests 10000 --seed 0

Prints a JSON summary (status counts, dropped connections, health, greedy answer unchanged) and
exits 1 if any check failed. The server it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

FIELDS = (
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
    "parallel_tool_calls",
    "user",
    "top_logprobs",
    "prompt_logprobs",
    "priority",
)
SCHEMAS = [
    {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    {"type": "object", "properties": {"n": {"type": "wat"}}},  # invalid: a 400
    {"type": "string", "pattern": "[a-"},  # invalid regex inside a schema
    True,
]
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"u": {"enum": ["c", "f"]}},
            "required": ["u"],
            "additionalProperties": False,
        },
    },
}


# the fuzzer sends integers longer than Python's default conversion limit (the server must not)
sys.set_int_max_str_digits(0)


def junk(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, hostile ones included."""
    kinds = ["null", "bool", "int", "huge", "float", "nan", "str", "list", "dict"]
    kind = rng.choice(kinds if depth < 2 else kinds[:7])
    return {
        "null": lambda: None,
        "bool": lambda: rng.random() < 0.5,
        "int": lambda: rng.randint(-5, 40),
        "huge": lambda: rng.choice(
            [2**63, -(2**63) - 1, 10**30, 2**64, 9223372036854775807, 10**5000]
        ),
        "float": lambda: rng.choice([0.0, 0.5, 1.0, -1.0, 1e308, 1e-320, 3.5e38]),
        "nan": lambda: rng.choice([float("nan"), float("inf"), float("-inf")]),
        "str": lambda: rng.choice(["", "hi", "def main(", "\n\n", "\x00", "é" * 3, "🙂"]),
        "list": lambda: [junk(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        "dict": lambda: {
            rng.choice(FIELDS): junk(rng, depth + 1) for _ in range(rng.randint(0, 2))
        },
    }[kind]()


def plausible(rng: random.Random, field: str, vocab: int) -> Any:
    """A value of the right type, sometimes out of range."""
    if field == "prompt":
        return rng.choice(
            [
                "def main(",
                "",
                [rng.randrange(vocab) for _ in range(rng.randint(1, 6))],
                [1, vocab],
                [-1, 2],
                [[3, 4, 5]],
                [[2**63]],
                [2**64, 1],
                ["a", "b"],
            ]
        )
    if field == "messages":
        return [
            {
                "role": "user",
                "content": rng.choice(["hi", "", None, [{"type": "text", "text": "hi"}]]),
            }
        ]
    return {
        "model": lambda: rng.choice(["tiny", "other"]),
        "max_tokens": lambda: rng.randint(-1, 6),
        "max_completion_tokens": lambda: rng.randint(0, 6),
        "temperature": lambda: rng.choice([0, 0.0, 0.7, 2, -0.1]),
        "top_p": lambda: rng.choice([1, 0.9, 0.0, 1.5]),
        "top_k": lambda: rng.choice([0, -1, 1, 5, 1000]),
        "seed": lambda: rng.choice([rng.randint(0, 2**32), 2**64, -1, True, 1.5]),
        "stop": lambda: rng.choice(["\n", ["a", "b"], [], ["x" * 300], ["s"] * 100]),
        "stop_token_ids": lambda: rng.choice(
            [[rng.randrange(vocab)], [2**64], [-1], [vocab + 5], [0] * 100]
        ),
        "stream": lambda: rng.random() < 0.5,
        "stream_options": lambda: {"include_usage": rng.random() < 0.5},
        "n": lambda: rng.choice([1, 2]),
        "ignore_eos": lambda: rng.random() < 0.5,
        "presence_penalty": lambda: rng.choice([0, 0.5, -2, 2.5, 1.5]),
        "frequency_penalty": lambda: rng.choice([0, 1.0, -1.5, 3]),
        "repetition_penalty": lambda: rng.choice([1, 1.2, 0.0, 0.8, -1]),
        "logit_bias": lambda: rng.choice(
            [
                {},
                {str(rng.randrange(vocab)): rng.uniform(-150, 150)},
                {str(vocab): 1},
                {"x": 1},
                {"3": "a"},
                {str(2**64): 1},
                {"5": float("inf")},
            ]
        ),
        "min_tokens": lambda: rng.choice([0, 1, 3, 50, -1]),
        "response_format": lambda: rng.choice(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "xml"},
                {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": rng.choice(SCHEMAS)},
                },
                {"type": "json_schema", "json_schema": {"name": "x"}},
            ]
        ),
        "structured_outputs": lambda: rng.choice(
            [
                {"regex": "[a-c]{1,3}"},
                {"regex": "[a-"},
                {"choice": ["yes", "no"]},
                {"choice": []},
                {"json": rng.choice(SCHEMAS)},
                {"grammar": 'start: "a" | "b"'},
                {"grammar": "start: (("},
                {"regex": "a", "choice": ["a"]},
                {"json_object": True, "disable_any_whitespace": True},
            ]
        ),
        "guided_json": lambda: rng.choice([*SCHEMAS, "{not json", json.dumps(SCHEMAS[0])]),
        "guided_regex": lambda: rng.choice(["[0-9]+", "(", ""]),
        "guided_choice": lambda: rng.choice([["a", "b"], [], [1, 2], "a"]),
        "guided_grammar": lambda: rng.choice(['root ::= "x" | "y"', 'start: "z"', "::="]),
        "tools": lambda: rng.choice([[TOOL], [], [{"type": "function"}], [TOOL, TOOL]]),
        "tool_choice": lambda: rng.choice(
            [
                "auto",
                "none",
                "required",
                "sometimes",
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "g"}},
            ]
        ),
        "parallel_tool_calls": lambda: rng.random() < 0.5,
    }.get(field, lambda: junk(rng))()


def request(rng: random.Random, vocab: int) -> tuple[str, bytes]:
    chat = rng.random() < 0.4
    body: dict[str, Any] = {"model": "tiny"}
    body["messages" if chat else "prompt"] = plausible(rng, "messages" if chat else "prompt", vocab)
    body["max_tokens"] = rng.randint(1, 4)
    for field in rng.sample(FIELDS, rng.randint(0, 5)):
        body[field] = plausible(rng, field, vocab) if rng.random() < 0.6 else junk(rng)
    raw = json.dumps(body).encode()
    if rng.random() < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # truncated JSON
    elif rng.random() < 0.03:
        raw = json.dumps(junk(rng)).encode()  # not an object at all
    elif rng.random() < 0.01:  # a field nested past what a recursive parser takes
        depth = rng.choice([1000, 5000, 100_000])
        raw = raw[:-1] + b', "stop": ' + b"[" * depth + b"]" * depth + b"}"
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


def is_openai_error(resp: Any) -> bool:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def send(client: Any, url: str, path: str, raw: bytes) -> tuple[int | str, bool, str]:
    """(status or 'dropped', whether a 4xx carried an OpenAI error body, the response text)."""
    import httpx

    try:
        with client.stream(
            "POST", url + path, content=raw, headers={"content-type": "application/json"}
        ) as resp:
            resp.read()
            ok_body = resp.status_code < 400 or resp.status_code >= 500 or is_openai_error(resp)
            return resp.status_code, ok_body, resp.text
    except httpx.HTTPError as exc:
        return "dropped", True, repr(exc)


def greedy(client: Any, url: str) -> str:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    return client.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]


def fuzz(url: str, vocab: int, requests: int, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    statuses: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    bad_bodies = 0
    with httpx.Client(timeout=60) as client:
        before = greedy(client, url)
        for _ in range(requests):
            path, raw = request(rng, vocab)
            status, ok_body, text = send(client, url, path, raw)
            statuses[str(status)] += 1
            bad_bodies += not ok_body
            failed = status == "dropped" or int(status) >= 500 or not ok_body
            if failed and len(failures) < 10:  # what to reproduce them with
                failures.append(
                    {
                        "path": path,
                        "body": raw.decode(errors="replace")[:600],
                        "status": status,
                        "response": text[:300],
                    }
                )
        health = client.get(url + "/health").status_code
        after = greedy(client, url)
    server_errors = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    return {
        "requests": requests,
        "seed": seed,
        "statuses": dict(sorted(statuses.items())),
        "server_errors": server_errors,
        "dropped": statuses.get("dropped", 0),
        "4xx_without_error_body": bad_bodies,
        "health_after": health,
        "greedy_unchanged": before == after,
        "ok": server_errors == 0
        and "dropped" not in statuses
        and bad_bodies == 0
        and health == 200
        and before == after,
        "failures": failures,
    }


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    vocab = json.loads((args.bundle / "bundle.json").read_text())["model"]["vocab_size"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "run",
        str(args.bundle),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
    ]
    # a file, not a pipe: the access log writes a line a request, and a pipe nobody reads while
    # the server runs would fill and block it
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            wait_healthy(url, server)
            t0 = time.perf_counter()
            summary = fuzz(url, vocab, args.requests, args.seed)
            summary["seconds"] = round(time.perf_counter() - t0, 1)
        finally:
            server.terminate()
            exit_status = server.wait(timeout=30)
        if not summary.get("ok"):
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
    summary["server_exit_status"] = exit_status
    print(json.dumps(summary, indent=2))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
