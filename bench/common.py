"""Helpers shared by the benchmark scripts: build-if-missing, HF decode loops, timing, reports."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def parse_args(
    ap: argparse.ArgumentParser, default_threads: int | None = None
) -> argparse.Namespace:
    """The script's arguments with `--threads N`: the engine's threads here and in every engine
    or server it starts (NEFFKIT_ENGINE_THREADS, which they inherit). Without it, neffkit's
    default: every usable CPU, one fewer while another process takes a core (the governor);
    `default_threads` where a peer runs a fixed count and both sides must match."""
    if "--threads" not in ap._option_string_actions:
        ap.add_argument(
            "--threads",
            type=int,
            default=default_threads,
            help="engine threads (default: neffkit's, which yields a core to a busy neighbour)",
        )
    args = ap.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be at least 1")
        os.environ["NEFFKIT_ENGINE_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    return args


def ensure_bundle(manifest: Path, bundle: Path) -> Path:
    """Build the bundle, or bring it up to date: a bundle kept from an older checkout would
    measure older code, and with neffkit's caches a build where nothing changed takes seconds."""
    cmd = [sys.executable, "-m", "neffkit", "build", str(manifest), "-o", str(bundle)]
    subprocess.run(cmd, check=True, cwd=REPO)
    return bundle


def cold_env(root: Path) -> dict[str, str]:
    """The environment of a build that finds no cache at all. `--no-cache` (or a fresh `--cache`)
    empties only neffkit's artifact cache; Inductor's compiled-graph cache and the kernel library
    with its autotune measurements (`NEFFKIT_KERNEL_CACHE`) live outside it, so without this a
    second "cold" build of the same model on one host is partly warm."""
    root.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "NEFFKIT_KERNEL_CACHE": str(root / "kernels"),
    }


def decode_step_times(
    engine: Any, prompts: list[list[int]], steps: int, adapters: list[str | None] | None = None
) -> list[float]:
    """Wall time of each engine step once every sequence is decoding (host work included);
    `adapters`: each prompt's adapter (bundles with `lora:`)."""
    from neffkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    names = adapters or [None] * len(prompts)
    seqs = [engine.add_request(p, params, name) for p, name in zip(prompts, names, strict=True)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine_description() -> dict[str, Any]:
    from neffkit.platform import host

    return {
        "cpu": host.cpu_description(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_description(), **data}, indent=2) + "\n")
    return path


class HFDecoder:
    """Greedy decode with an HF model: eager (dynamic cache) or compiled (static cache)."""

    def __init__(self, model_dir: Path, compiled: bool, max_len: int) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
        self.compiled = compiled
        self.max_len = max_len
        self.forward = (
            torch.compile(self.model.forward, fullgraph=True, dynamic=False)
            if compiled
            else self.model.forward
        )

    def _cache(self, batch: int) -> Any:
        import transformers

        if self.compiled:
            return transformers.StaticCache(config=self.model.config, max_cache_len=self.max_len)
        return transformers.DynamicCache(config=self.model.config)

    @torch.no_grad()
    def decode_times(self, prompt: torch.Tensor, steps: int) -> list[float]:
        """Prefill `prompt` [B, S], then time each of `steps` greedy decode steps (seconds)."""
        batch, length = prompt.shape
        cache = self._cache(batch)
        out = self.model(
            prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(length)
        )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for i in range(steps):
            pos = torch.tensor([length + i])
            t0 = time.perf_counter()
            logits = self.forward(
                token, past_key_values=cache, use_cache=True, cache_position=pos
            ).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            _ = token.tolist()  # the host reads the token, as a server must
            times.append(time.perf_counter() - t0)
        return times


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "neffkit", "run", str(bundle), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO)
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    proc.wait()
    raise SystemExit("the server did not become healthy")
