"""What the data-parallel tests ask of a server at a URL: greedy completions sent at once, and
a metric's value per engine."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx


def complete_all(url: str, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    """Greedy completions of every prompt, all requests concurrent; each one's token ids (a
    status other than 200 fails the test)."""

    def one(prompt: list[int]) -> list[int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body["return_token_ids"] = True
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert out.status_code == 200, out.text
        return out.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def per_engine(url: str, name: str) -> dict[str, float]:
    """engine label → the metric's value there (summed over its other labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        engine = re.search(r'engine="([^"]+)"', m.group(1))
        if engine:
            out[engine.group(1)] = out.get(engine.group(1), 0) + float(m.group(2))
    return out
