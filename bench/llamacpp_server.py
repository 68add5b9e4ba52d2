"""llama-server beside `neffkit run` for bench/llamacpp.py: `LlamaServer` starts and stops
llama.cpp's HTTP server on a GGUF (its greedy tokens are read through it too), and
`serving` measures both servers' output tokens/s with bench/serve.py's client, 1 and 8 streams,
rounds alternating the two. The server processes are their own concern: the offline figures
never start one.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    free_port,
    median,  # noqa: E402
    start_server,
)
from llamacpp_build import threads  # noqa: E402
from serve import run_level, workload  # noqa: E402


class LlamaServer:
    """`llama-server -np 8` on a GGUF, stopped when the block ends."""

    def __init__(self, binary: Path, model: Path, parallel: int = 8) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            str(binary),
            "-m",
            str(model),
            "-np",
            str(parallel),
            "-c",
            str(256 * parallel),
            "-t",
            str(threads()),
            "--port",
            str(self.port),
            "--no-webui",
        ]

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            if self.proc.poll() is not None:  # died starting (a signal: negative)
                raise subprocess.CalledProcessError(self.proc.returncode, self.cmd)
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise SystemExit("llama-server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        body = {
            "prompt": prompt,
            "n_predict": n,
            "samplers": ["top_k"],
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": False,
        }
        return httpx.post(f"{self.url}/completion", json=body, timeout=300).json()["tokens"]


def serve_levels(url: str, args: argparse.Namespace) -> dict[str, float]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    rates = {}
    for c in (1, 8):
        prompts = workload(c, c * args.requests_per_client, 32, 1000)
        level = asyncio.run(run_level(url, model, c, prompts, 64))
        rates[f"streams_{c}"] = level["output_tokens_per_s"]
    return rates


def serving(
    kind: str, bundle: Path, server: Path, model: Path, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    samples: dict[str, dict[str, list[float]]] = {"neffkit": {}, "llamacpp": {}}
    for _ in range(args.rounds):
        with LlamaServer(server, model) as srv:
            for k, v in serve_levels(srv.url, args).items():
                samples["llamacpp"].setdefault(k, []).append(v)
        proc, url = start_server(bundle, "--threads", str(threads()))
        try:
            for k, v in serve_levels(url, args).items():
                samples["neffkit"].setdefault(k, []).append(v)
        finally:
            proc.terminate()
            proc.wait()
    return {s: {k: round(median(v), 1) for k, v in d.items()} for s, d in samples.items()}
