"""Host time per decode step spent outside the compiled graph call.

Every graph's `run` is wrapped with a timer; a decode step's overhead is the step's wall time minus
its graph call: scheduling, bucket pick, metadata build, numpy → tensor conversion and reading back
the tokens. Reported absolute and as a share of the step, at batch 1 and the largest batch.

    python bench/overhead.py [--manifest manifests/demo.yaml] [--steps 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, parse_args, write_result  # noqa: E402

from neffkit.runtime.engine.core import EngineCore  # noqa: E402
from neffkit.runtime.engine.loading import load  # noqa: E402
from neffkit.runtime.sampling_params import SamplingParams  # noqa: E402


def measure(engine, batch: int, steps: int) -> dict[str, float]:
    graph_time = [0.0]

    def timed(run):
        def wrapper(meta):
            t0 = time.perf_counter()
            out = run(meta)
            graph_time[0] += time.perf_counter() - t0
            return out

        return wrapper

    runner = engine.runner
    originals = dict(runner.graphs)
    runner.graphs = {k: dataclasses.replace(g, run=timed(g.run)) for k, g in originals.items()}
    try:
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        seqs = [engine.add_request([5 + i, 6, 7, 8], params) for i in range(batch)]
        while any(not s.output_ids for s in seqs):
            engine.step()
        overheads, totals = [], []
        while engine.has_work():
            graph_time[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            totals.append(total)
            overheads.append(total - graph_time[0])
    finally:
        runner.graphs = originals
    over, tot = statistics.median(overheads), statistics.median(totals)
    return {"batch": batch, "step_us": 1e6 * tot, "overhead_us": 1e6 * over, "share": over / tot}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=REPO / "manifests" / "demo.yaml")
    ap.add_argument("--bundle", type=Path, default=REPO / "bundles" / "demo-llama")
    ap.add_argument("--steps", type=int, default=200)
    args = parse_args(ap)
    engine = EngineCore(load(ensure_bundle(args.manifest, args.bundle)).runner)
    rows = []
    for batch in (1, engine.scheduler.layout.decode_buckets[-1]):
        measure(engine, batch, 20)  # warm-up
        row = measure(engine, batch, args.steps)
        rows.append(row)
        print(
            f"batch {batch}: step {row['step_us']:.1f} µs, outside the graph "
            f"{row['overhead_us']:.1f} µs ({100 * row['share']:.1f}%)"
        )
    print(f"written {write_result('overhead', {'bundle': str(args.bundle), 'rows': rows})}")


if __name__ == "__main__":
    main()
