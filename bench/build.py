"""Build times: cold with --jobs 1 vs --jobs 2 (parallel efficiency), warm rebuild vs cold.

Each cold build gets an empty cache directory; the warm rebuild reuses the --jobs 2 cache. Runs the
real CLI in subprocesses, one after another, in one invocation. Usage:

    python bench/build.py [--manifest manifests/demo.yaml]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result  # noqa: E402


def timed_build(manifest: Path, out: Path, cache: Path, jobs: int) -> tuple[float, dict]:
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "build",
        str(manifest),
        "-o",
        str(out),
        "--cache",
        str(cache),
        "--jobs",
        str(jobs),
        "--json",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    return time.perf_counter() - t0, json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "demo.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cold1, r1 = timed_build(args.manifest, root / "b1", root / "cache1", jobs=1)
        cold2, r2 = timed_build(args.manifest, root / "b2", root / "cache2", jobs=2)
        warm, r3 = timed_build(args.manifest, root / "b3", root / "cache2", jobs=2)
    graphs = r1["counters"]["graphs"]
    rows = {
        "graphs": graphs,
        "cold_jobs1_s": round(cold1, 2),
        "cold_jobs2_s": round(cold2, 2),
        "speedup_jobs2": round(cold1 / cold2, 3),
        "parallel_efficiency_jobs2": round(cold1 / cold2 / 2, 3),
        "warm_rebuild_s": round(warm, 2),
        "warm_fraction_of_cold_jobs2": round(warm / cold2, 3),
        "warm_compiled": r3["counters"]["compiled"],
        "stage_seconds": {
            "cold_jobs1": r1["seconds"],
            "cold_jobs2": r2["seconds"],
            "warm": r3["seconds"],
        },
    }
    print(f"{graphs} graphs from {args.manifest.name}")
    print(f"cold, --jobs 1 : {cold1:7.1f} s")
    print(
        f"cold, --jobs 2 : {cold2:7.1f} s   speedup {cold1 / cold2:.2f}x, "
        f"efficiency {cold1 / cold2 / 2:.0%}"
    )
    print(
        f"warm rebuild   : {warm:7.1f} s   {warm / cold2:.1%} of cold (--jobs 2), "
        f"{r3['counters']['compiled']} compiled"
    )
    print(f"wrote {write_result('build', {'manifest': str(args.manifest), **rows})}")


if __name__ == "__main__":
    main()
