"""bench/soak.py's traffic: shared prompt prefixes, questions, a JSON schema, and the hostile
requests it sprinkles in (each must answer 4xx and leave the server serving)."""

from __future__ import annotations

import json

JSON = {"Content-Type": "application/json"}

# long shared prefixes (several KV blocks each), as system prompts are
PREFIXES = [
    "You are a helpful assistant who answers in one short paragraph. " * 4,
    "You are a careful geography teacher. Answer precisely and name your sources. " * 3,
    "Translate the following question into plain English, then answer it briefly. " * 3,
    "You are a terse assistant. Reply with as few words as you can while being correct. " * 3,
]
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three rivers in Europe.",
    "How many legs does a spider have?",
    "What does a compiler do?",
    "Write a haiku about the sea.",
    "Repeat after me: one two three four five six seven eight.",
    "List the days of the week.",
]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


def _body(fields: dict) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 4, **fields}).encode()


COMPLETIONS = "/v1/completions"
# (path, body, headers)
HOSTILE: list[tuple[str, bytes, dict[str, str]]] = [
    (COMPLETIONS, _body({"min_tokens": 2, "stop_token_ids": [2**64]}), JSON),
    (COMPLETIONS, _body({"seed": 2**70}), JSON),
    (COMPLETIONS, _body({"logit_bias": {"99999999999999999999": 5}}), JSON),
    (COMPLETIONS, _body({"prompt": [[2**63]]}), JSON),
    (COMPLETIONS, _body({"max_tokens": -1}), JSON),
    (COMPLETIONS, b'{"prompt": "hi", "temperature": 1e400}', JSON),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, JSON),
    (COMPLETIONS, b'{"prompt": "hi"', JSON),
    (COMPLETIONS, _body({}), {"Content-Type": "text/plain"}),
    (COMPLETIONS, _body({"stop": ["x" * 300] * 2000}), JSON),
    (COMPLETIONS, _body({"guided_regex": "(a|b)*a(a|b){30}"}), JSON),
    (COMPLETIONS, _body({"guided_regex": "(a{1000}){1000}"}), JSON),
    (COMPLETIONS, b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}', JSON),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
        JSON,
    ),
    ("/v1/chat/completions", json.dumps({"messages": "hi", "n": 10**9}).encode(), JSON),
]
