"""One peer measurement, run inside `.venv-peers` by bench/peers.py (never imports neffkit).

The peers pin their own transformers (optimum-intel), so they live in a venv of their own and this
script talks to bench/peers.py through argv and one JSON line on stdout. Commands:

    export-ov MODEL OUT              optimum-cli export openvino (fp32 weights), timed
    export-ort MODEL OUT PRECISION   onnxruntime_genai.models.builder -p fp32|bf16 -e cpu, timed
    run-ov OUT PRECISION JOB WORK    PRECISION f32|bf16 (INFERENCE_PRECISION_HINT); JOB b1|b8
    run-ort OUT PRECISION JOB WORK

Job b1: one prompt, greedy, per-token decode time (median over steps, prefill excluded) and the
tokens. Job b8: eight prompts at once through OpenVINO's ContinuousBatchingPipeline (ONNX Runtime
GenAI: one batched generator), end to end (prefill included), aggregate tokens/s.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _emit(data: dict) -> None:
    print(json.dumps(data), flush=True)


def export_ov(model: str, out: str) -> None:
    t0 = time.perf_counter()
    cmd = [
        str(Path(sys.executable).parent / "optimum-cli"),
        "export",
        "openvino",
        "-m",
        model,
        "--task",
        "text-generation-with-past",
        "--weight-format",
        "fp32",
        out,
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    _emit({"build_s": time.perf_counter() - t0})


def export_ort(model: str, out: str, precision: str) -> None:
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        model,
        "-o",
        out,
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        out + ".cache",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    _emit({"build_s": time.perf_counter() - t0})


def run_ov(out: str, precision: str, job: str, work: dict) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    props = {"INFERENCE_PRECISION_HINT": precision}
    config = og.GenerationConfig()
    config.max_new_tokens = work["new_tokens"]
    config.ignore_eos = True
    config.do_sample = False
    prompts = work["prompts"]
    if job == "b1":
        pipe = og.LLMPipeline(out, "CPU", **props)
        tokens, tpot = None, []
        for _ in range(work["repeats"]):
            ids = ov.Tensor(np.array([prompts[0]], dtype=np.int64))
            result = pipe.generate(ids, config)
            tokens = [int(t) for t in result.tokens[0]]
            tpot.append(result.perf_metrics.get_tpot().mean / 1000)
        _emit({"token_s": statistics.median(tpot), "tokens": tokens})
        return
    sched = og.SchedulerConfig()
    sched.max_num_batched_tokens = 256
    sched.cache_size = 1  # GB of KV cache
    pipe = og.ContinuousBatchingPipeline(out, sched, "CPU", props)
    inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
    rates = []
    for _ in range(work["repeats"]):
        t0 = time.perf_counter()
        results = pipe.generate(inputs, [config] * len(inputs))
        seconds = time.perf_counter() - t0
        made = sum(len(r.m_generation_ids[0]) for r in results)
        rates.append(made / seconds)
    first = [int(t) for t in results[0].m_generation_ids[0]]
    _emit({"tokens_per_s": statistics.median(rates), "tokens": first})


def run_ort(out: str, job: str, work: dict) -> None:
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(out)
    prompts = work["prompts"] if job == "b8" else work["prompts"][:1]
    new = work["new_tokens"]
    results = []
    for _ in range(work["repeats"]):
        params = og.GeneratorParams(model)
        length = len(prompts[0]) + new
        params.set_search_options(
            max_length=length, min_length=length, do_sample=False, batch_size=len(prompts)
        )
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array(prompts, dtype=np.int32))
        steps = []
        while not gen.is_done():
            s0 = time.perf_counter()
            gen.generate_next_token()
            steps.append(time.perf_counter() - s0)
        seconds = time.perf_counter() - t0
        tokens = [int(t) for t in gen.get_sequence(0)[len(prompts[0]) :]]
        results.append((statistics.median(steps), len(prompts) * new / seconds, tokens))
    if job == "b1":
        _emit({"token_s": statistics.median(r[0] for r in results), "tokens": results[0][2]})
    else:
        _emit({"tokens_per_s": statistics.median(r[1] for r in results), "tokens": results[0][2]})


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "export-ov":
        export_ov(*args)
    elif command == "export-ort":
        export_ort(*args)
    elif command == "run-ov":
        out, precision, job, work = args
        run_ov(out, precision, job, json.loads(work))
    elif command == "run-ort":
        out, _, job, work = args
        run_ort(out, job, json.loads(work))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
