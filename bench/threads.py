"""Serving on a shared host: 8-stream throughput of `neffkit run` quiet and beside one CPU-bound
process, per engine thread setting, and the default under a CPU limit.

The 125M model of bench/batch.py (float32, the default kernel). Each setting serves 8 streams
(--requests-per-client requests of --output-len tokens each, bench/serve.py's client) with the
machine otherwise quiet, then again while a busy-loop process competes for one core; settings
alternate for --rounds rounds, medians. Settings: the default (one thread per usable CPU),
`--threads 1`, and the default with OpenMP's passive wait policy (`OMP_WAIT_POLICY=PASSIVE`:
threads sleep at the end of a parallel region instead of spinning). Last, `taskset -c 0
neffkit run --json` reports the engine's threads under a one-CPU affinity mask. Writes
bench/results/threads.json.

    .venv/bin/python bench/threads.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import bundle as batch_bundle  # noqa: E402
from common import median, start_server, write_result  # noqa: E402
from serve import run_level, workload  # noqa: E402

SETTINGS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": ((), {}),
    "--threads 1": (("--threads", "1"), {}),
    "OMP_WAIT_POLICY=PASSIVE": ((), {"OMP_WAIT_POLICY": "PASSIVE"}),
    "GOMP_SPINCOUNT=10000": ((), {"GOMP_SPINCOUNT": "10000"}),
    "GOMP_SPINCOUNT=300000": ((), {"GOMP_SPINCOUNT": "300000"}),
}
BUSY = [sys.executable, "-c", "while True: pass"]


def serve_once(bundle: Path, flags: tuple[str, ...], env: dict[str, str], args) -> dict:
    """(quiet tok/s, contended tok/s) of one server."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the engine core inherits it before its OpenMP runtime loads
    try:
        proc, url = start_server(bundle, "--no-access-log", *flags)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        prompts = workload(8, 8 * args.requests_per_client, 32, 32000)
        asyncio.run(run_level(url, model, 8, prompts[:8], 8))  # warm-up
        quiet = asyncio.run(run_level(url, model, 8, prompts, args.output_len))
        busy = subprocess.Popen(BUSY)
        try:
            contended = asyncio.run(run_level(url, model, 8, prompts, args.output_len))
        finally:
            busy.kill()
            busy.wait()
        return {
            "quiet": quiet["output_tokens_per_s"],
            "contended": contended["output_tokens_per_s"],
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def pinned_threads(bundle: Path) -> int:
    """The engine's threads under `taskset -c 0`, as `run --json` reports them."""
    env = {k: v for k, v in os.environ.items() if k != "NEFFKIT_ENGINE_THREADS"}
    out = subprocess.run(
        [
            "taskset",
            "-c",
            "0",
            sys.executable,
            "-m",
            "neffkit",
            "run",
            str(bundle),
            "--prompt-ids",
            "5,6,7",
            "--max-tokens",
            "2",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)["timings"]["threads"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args = ap.parse_args()
    bundle = batch_bundle("float32", "kernel")
    chosen = {name: SETTINGS[name] for name in args.settings}
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for _ in range(args.rounds):
        for name, (flags, env) in chosen.items():
            result = serve_once(bundle, flags, env, args)
            runs[name].append(result)
            print(
                f"{name}: quiet {result['quiet']:.1f} tok/s, "
                f"contended {result['contended']:.1f} tok/s",
                flush=True,
            )
    rows = []
    for name, results in runs.items():
        quiet = median([r["quiet"] for r in results])
        contended = median([r["contended"] for r in results])
        rows.append(
            {
                "setting": name,
                "quiet_tok_s": round(quiet, 1),
                "contended_tok_s": round(contended, 1),
                "kept": round(contended / quiet, 3),
            }
        )
    threads = pinned_threads(bundle)
    for row in rows:
        print(
            f"{row['setting']:>26}: quiet {row['quiet_tok_s']} tok/s, with a busy process "
            f"{row['contended_tok_s']} tok/s ({row['kept']:.0%} kept)"
        )
    print(f"taskset -c 0: {threads} engine thread(s)")
    write_result(
        "threads",
        {
            "model": "random Llama, 125M parameters (bench/batch.py's checkpoint), float32",
            "method": f"8 streams x {args.requests_per_client} requests x {args.output_len} tokens "
            "(bench/serve.py's client), quiet then beside one busy-loop process, settings "
            f"alternating, {args.rounds} rounds, medians",
            "rows": rows,
            "taskset_c0_engine_threads": threads,
        },
    )


if __name__ == "__main__":
    main()
