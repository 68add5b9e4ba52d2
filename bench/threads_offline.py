"""Offline generation on a shared host: `neffkit run --prompt-ids` quiet and beside one busy
process, with the default threads (the governor) and with `--threads 1`.

SmolLM2-135M-Instruct float32 (the `make demo` bundle), one 40-token prompt, 128 tokens
(--ignore-eos). Each round runs every (setting, host) pair; the busy host is one busy-loop
process started before the run and stopped after it. `--threads N` at every usable CPU is the
default without the governor. Settings alternate, --rounds rounds,
medians of the generation wall time (`timings.wall_s`: loading apart). Writes
bench/results/threads_offline.json.

    .venv/bin/python bench/threads_offline.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, median, write_result  # noqa: E402

USABLE = len(os.sched_getaffinity(0))
# the default; one thread; every usable CPU fixed (what the default was before the governor)
SETTINGS = {
    "default": (),
    "--threads 1": ("--threads", "1"),
    f"--threads {USABLE}": ("--threads", str(USABLE)),
}
BUSY = [sys.executable, "-c", "while True: pass"]
PROMPT = ",".join(str(100 + i) for i in range(40))


def run_once(bundle: Path, flags: tuple[str, ...], tokens: int, busy: bool) -> dict:
    cmd = [sys.executable, "-m", "neffkit", "run", str(bundle), "--prompt-ids", PROMPT]
    cmd += ["--max-tokens", str(tokens), "--ignore-eos", "--json", *flags]
    hog = subprocess.Popen(BUSY) if busy else None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return json.loads(out.stdout)["timings"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    bundle = ensure_bundle(
        REPO / "manifests" / "smollm2.yaml", REPO / "bundles" / "smollm2-135m-instruct"
    )
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for host in ("quiet", "busy"):
            for name, flags in SETTINGS.items():
                t = run_once(bundle, flags, args.tokens, host == "busy")
                runs.setdefault((name, host), []).append(t)
                print(
                    f"round {r}: {name}, {host}: {t['wall_s']:.2f} s, "
                    f"{t['threads']} thread(s) at the end",
                    flush=True,
                )
    quiet = median([t["wall_s"] for t in runs[("default", "quiet")]])
    rows = []
    for (name, host), results in runs.items():
        wall = median([t["wall_s"] for t in results])
        rows.append(
            {
                "setting": name,
                "host": host,
                "wall_s": round(wall, 3),
                "vs_quiet_default": round(wall / quiet, 2),
                "threads_at_end": [t["threads"] for t in results],
                "thread_reductions": [t.get("thread_reductions", 0) for t in results],
            }
        )
        print(rows[-1])
    write_result(
        "threads_offline",
        {
            "model": "SmolLM2-135M-Instruct float32 (the make demo bundle)",
            "method": f"`neffkit run --prompt-ids` (40 tokens) `--max-tokens {args.tokens} "
            "--ignore-eos --json`, quiet and beside one busy-loop process, settings alternating, "
            f"{args.rounds} rounds, median generation wall time",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
