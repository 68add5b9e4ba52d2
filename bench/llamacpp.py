"""neffkit against llama.cpp on SmolLM2-135M-Instruct: the same weights, the same run.

llama.cpp is built from the tree `llama-cpp-python==0.3.36`'s sdist vendors (`vendor/llama.cpp`,
cmake, `GGML_NATIVE=ON`: AVX-512, VNNI and bf16 where the CPU has them, OpenMP), and the
HF-format checkpoint `make demo` converts (models/smollm2-135m-instruct) goes through its
`convert_hf_to_gguf.py` into f32, bf16 and Q8_0 GGUFs, in a venv of its own (the converter pins
transformers 4.57). neffkit builds float32, bfloat16 and block-fp8 (128x128,
tools/make_fp8_model.py) bundles of the same checkpoint, with packed prefill; the fp8 one
quantizes its LM head too (`lm_head: {dtype: float8_e4m3fn}`), as Q8_0 quantizes its output
tensor. Both sides run 2 threads.

Reported, rounds alternating the systems, medians:
- batch 1: ms per token (llama.cpp: `llama-bench -p 0 -n 64`; neffkit: the median decode step);
- batch 8: 8 prompts of 4 tokens, 48 new tokens each, end to end, output tokens/s
  (`llama-batched-bench -npp 4 -ntg 48 -npl 8`; neffkit: `LLM.generate`);
- serving: `llama-server -np 8` against `neffkit run`, 1 and 8 streams of bench/serve.py's client
  (32-token prompts, 64 tokens out, greedy, ignore_eos);
- greedy tokens of both against HF transformers (float32) on chat prompts, up to EOS.

Writes bench/results/llamacpp.json (`--result llamacpp_intel`: a second host's figures kept
beside the first's). Everything is fetched and built under bench/work/llamacpp
once (the llama.cpp build takes ~15 min on 2 cores).

    make llamacpp  # or: .venv/bin/python bench/llamacpp.py [--rounds 3] [--skip-serve] [--result N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, decode_step_times, ensure_bundle, median, write_result  # noqa: E402
from serve import _free_port, run_level, start_server, workload  # noqa: E402

WORK = REPO / "bench" / "work" / "llamacpp"
SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp at commit 0c1e57098 (its CHANGELOG)
COMMIT = "0c1e57098"
MODEL = REPO / "models" / "smollm2-135m-instruct"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server")
THREADS = 2
PROMPTS = [[5 + i, 6, 7, 8] for i in range(8)]  # bench/peers.py's batch-8 work
NEW_TOKENS = 48
B1_TOKENS = 64
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a compiler does in two sentences.",
]
GREEDY_TOKENS = 48
# neffkit kind -> (bundle dtype, llama.cpp GGUF type of the same precision)
KINDS = {"float32": "f32", "bfloat16": "bf16", "fp8": "q8_0"}
MANIFEST = """neffkit: 1
name: llamacpp-{kind}
model: {model}
dtype: {dtype}
buckets: {{prefill: [64], prefill_batch: [1, 8], decode: [1, 8], context: [256]}}
{extra}"""


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ------------------------------------------------------------------ llama.cpp, built once
def source() -> Path:
    """llama.cpp's tree from the sdist (no .git: the commit is passed to cmake)."""
    src = WORK / "src"
    if not (src / "CMakeLists.txt").exists():
        WORK.mkdir(parents=True, exist_ok=True)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                SDIST,
                "-d",
                WORK,
            ]
        )
        archive = next(WORK.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(WORK / "sdist", filter="data")
        top = next((WORK / "sdist").iterdir())
        shutil.move(str(top / "vendor" / "llama.cpp"), src)
        shutil.rmtree(WORK / "sdist")
    return src


def binaries() -> dict[str, Path]:
    build = WORK / "build"
    found = {t: build / "bin" / t for t in TARGETS}
    if all(p.exists() for p in found.values()):
        return found
    if shutil.which("cmake") is None:
        raise SystemExit("llama.cpp needs cmake: apt-get install cmake")
    run(
        [
            "cmake",
            "-S",
            source(),
            "-B",
            build,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DGGML_CUDA=OFF",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_TESTS=OFF",
            f"-DLLAMA_BUILD_COMMIT={COMMIT}",
        ],
        stdout=subprocess.DEVNULL,
    )
    run(
        ["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
        stdout=subprocess.DEVNULL,
    )
    return found


def converter_python() -> Path:
    """A venv for convert_hf_to_gguf.py: it pins transformers 4.57 (neffkit's is 5)."""
    venv = WORK / "convert-venv"
    python = venv / "bin" / "python"
    stamp = venv / ".ready"
    if not stamp.exists():
        run([sys.executable, "-m", "venv", venv])
        run([python, "-m", "pip", "install", "-q", "torch==2.13.0"])
        run(
            [
                python,
                "-m",
                "pip",
                "install",
                "-q",
                "transformers==4.57.6",
                "sentencepiece",
                "protobuf<5",
                "numpy",
                "tqdm",
                "pyyaml",
                "requests",
            ]
        )
        stamp.touch()
    return python


def converter_input() -> Path:
    """The checkpoint as the converter reads it: transformers 5 writes `tokenizer_class:
    TokenizersBackend`, which 4.57 rejects; `PreTrainedTokenizerFast` is the same tokenizer."""
    out = WORK / "hf"
    out.mkdir(parents=True, exist_ok=True)
    for f in MODEL.iterdir():
        target = out / f.name
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text())
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            target.write_text(json.dumps(config, indent=2))
        elif not target.exists():
            target.symlink_to(f.resolve())
    return out


def gguf(outtype: str) -> Path:
    out = WORK / f"smollm2-135m-instruct-{outtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        run(
            [
                converter_python(),
                source() / "convert_hf_to_gguf.py",
                converter_input(),
                "--outtype",
                outtype,
                "--outfile",
                tmp,
            ],
            stdout=subprocess.DEVNULL,
        )
        tmp.rename(out)
    return out


# ------------------------------------------------------------------ neffkit bundles
def fp8_checkpoint() -> Path:
    """SmolLM2 with block-fp8 projections (128x128, tools/make_fp8_model.py), made once."""
    model = WORK / "smollm2-fp8"
    if not (model / "config.json").exists():
        run(
            [
                sys.executable,
                REPO / "tools" / "make_fp8_model.py",
                MODEL,
                model,
                "--block",
                "128",
                "128",
            ]
        )
    return model


def neffkit_bundle(kind: str) -> Path:
    model, dtype, extra = MODEL, kind, ""
    if kind == "fp8":  # norms and the embedding table in bf16; the head in fp8, as Q8_0's
        model, dtype = fp8_checkpoint(), "bfloat16"
        extra = "lm_head: {dtype: float8_e4m3fn}\n"
    manifest = WORK / f"neffkit-{kind}.yaml"
    manifest.write_text(MANIFEST.format(kind=kind, model=model, dtype=dtype, extra=extra))
    return ensure_bundle(manifest, WORK / f"bundle-{kind}")


# ------------------------------------------------------------------ the measurements
def llama_b1_ms(binary: Path, model: Path) -> float:
    out = run(
        [binary, "-m", model, "-p", "0", "-n", B1_TOKENS, "-t", THREADS, "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)[0]["avg_ns"] / B1_TOKENS / 1e6


def llama_b8_tokens_per_s(binary: Path, model: Path) -> float:
    out = run(
        [
            binary,
            "-m",
            model,
            "-c",
            "1024",
            "-b",
            "512",
            "-ub",
            "512",
            "-npp",
            "4",
            "-ntg",
            NEW_TOKENS,
            "-npl",
            len(PROMPTS),
            "-t",
            THREADS,
            "--output-format",
            "jsonl",
        ],
        capture_output=True,
        text=True,
    ).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return row["pl"] * row["tg"] / row["t"]  # output tokens, as neffkit's figure counts


def guarded(failures: dict[str, str], name: str, figure: Callable[[], Any]) -> Any:
    """A llama.cpp figure, or None once llama.cpp has died by a signal on it on this host (a
    crash is a result too: it is recorded, and the other figures are still measured)."""
    if name in failures:
        return None
    try:
        return figure()
    except subprocess.CalledProcessError as exc:
        if exc.returncode >= 0:
            raise
        failures[name] = f"{Path(exc.cmd[0]).name} died by {signal.Signals(-exc.returncode).name}"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:  # llama-server died mid-request
        failures[name] = f"llama-server: {type(exc).__name__}: {exc}"
    return None


def neffkit_b1_ms(llm: Any) -> float:
    return 1000 * median(decode_step_times(llm.core, PROMPTS[:1], B1_TOKENS))


def neffkit_b8_tokens_per_s(llm: Any) -> float:
    from neffkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = llm.generate(PROMPTS, params)
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t0)


class LlamaServer:
    """`llama-server -np 8` on a GGUF, stopped when the block ends."""

    def __init__(self, binary: Path, model: Path, parallel: int = 8) -> None:
        self.port = _free_port()
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
            str(THREADS),
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


# ------------------------------------------------------------------ greedy tokens against HF
def chat_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": c}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for c in CHATS
    ]


def hf_greedy(prompts: list[list[int]]) -> list[list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    outs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    return outs


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def agreement(got: list[list[int]], want: list[list[int]], eos: set[int]) -> dict[str, Any]:
    """Identical prompts, and tokens before the first difference (EOS itself not counted:
    llama.cpp does not return it)."""
    got = [_until_eos(g, eos) for g in got]
    want = [_until_eos(w, eos) for w in want]
    prefix = 0
    for g, w in zip(got, want, strict=True):
        prefix += next(
            (i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w))
        )
    return {
        "identical": sum(g == w for g, w in zip(got, want, strict=True)),
        "prompts": len(want),
        "tokens_before_first_difference": prefix,
        "reference_tokens": sum(len(w) for w in want),
    }


def llama_greedy(server: Path, model: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LlamaServer(server, model, parallel=1) as srv:
        return [srv.greedy(p, GREEDY_TOKENS) for p in prompts]


def greedy_against_hf(
    llms: dict[str, Any], server: Path, ggufs: dict[str, Path], failures: dict[str, str]
) -> dict[str, dict[str, Any]]:
    from neffkit.runtime.sampling_params import SamplingParams

    prompts = chat_prompts()
    reference = hf_greedy(prompts)
    config = json.loads((MODEL / "generation_config.json").read_text())
    eos = config.get("eos_token_id")
    eos = set(eos) if isinstance(eos, list) else {eos}
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0)
    out: dict[str, dict[str, Any]] = {}
    for kind, llm in llms.items():
        got = [list(s.output_ids) for s in llm.generate(prompts, params)]
        out[f"neffkit_{kind}"] = agreement(got, reference, eos)
        got = guarded(
            failures,
            f"{KINDS[kind]} greedy",
            lambda kind=kind: llama_greedy(server, ggufs[kind], prompts),
        )
        if got is not None:
            out[f"llamacpp_{KINDS[kind]}"] = agreement(got, reference, eos)
    return out


# ------------------------------------------------------------------ the run
def one_round(
    bins: dict[str, Path], kind: str, model: Path, llm: Any, failures: dict[str, str]
) -> dict[tuple[str, str], float | None]:
    """Each figure once, llama.cpp and neffkit alternating."""
    bench, batched = bins["llama-bench"], bins["llama-batched-bench"]
    return {
        ("llamacpp", "b1"): guarded(
            failures, f"{KINDS[kind]} b1", lambda: llama_b1_ms(bench, model)
        ),
        ("neffkit", "b1"): neffkit_b1_ms(llm),
        ("llamacpp", "b8"): guarded(
            failures, f"{KINDS[kind]} b8", lambda: llama_b8_tokens_per_s(batched, model)
        ),
        ("neffkit", "b8"): neffkit_b8_tokens_per_s(llm),
    }


def serving(
    kind: str, bundle: Path, server: Path, model: Path, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    samples: dict[str, dict[str, list[float]]] = {"neffkit": {}, "llamacpp": {}}
    for _ in range(args.rounds):
        with LlamaServer(server, model) as srv:
            for k, v in serve_levels(srv.url, args).items():
                samples["llamacpp"].setdefault(k, []).append(v)
        proc, url = start_server(bundle, "--threads", str(THREADS))
        try:
            for k, v in serve_levels(url, args).items():
                samples["neffkit"].setdefault(k, []).append(v)
        finally:
            proc.terminate()
            proc.wait()
    return {s: {k: round(median(v), 1) for k, v in d.items()} for s, d in samples.items()}


def _median(samples: dict[tuple[str, str, str], list[float]], *key: str) -> float | None:
    return median(samples[key]) if key in samples else None  # none: llama.cpp died on each


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--result", default="llamacpp", help="name of the bench/results/*.json written")
    args = ap.parse_args()
    import torch

    from neffkit.runtime.llm import LLM
    from neffkit.runtime.loader import load

    if not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL.relative_to(REPO)}: missing; `make demo` converts it")
    bins = binaries()
    ggufs = {kind: gguf(outtype) for kind, outtype in KINDS.items()}
    bundles = {kind: neffkit_bundle(kind) for kind in KINDS}
    torch.set_num_threads(THREADS)
    llms = {kind: LLM(load(path)) for kind, path in bundles.items()}
    samples: dict[tuple[str, str, str], list[float]] = {}
    failures: dict[str, str] = {}
    for r in range(args.rounds):  # alternate: the machine's noise hits both alike
        for kind in KINDS:
            for key, value in one_round(bins, kind, ggufs[kind], llms[kind], failures).items():
                if value is not None:
                    samples.setdefault((kind, *key), []).append(value)
        print(
            f"round {r + 1}: "
            + ", ".join(f"{'/'.join(k)} {v[-1]:.2f}" for k, v in samples.items()),
            flush=True,
        )
    rows = {}
    for kind, outtype in KINDS.items():
        ours_b1, theirs_b1 = (_median(samples, kind, s, "b1") for s in ("neffkit", "llamacpp"))
        ours_b8, theirs_b8 = (_median(samples, kind, s, "b8") for s in ("neffkit", "llamacpp"))
        rows[kind] = {
            "llamacpp_type": outtype,
            "neffkit_b1_ms": _round(ours_b1, 2),
            "llamacpp_b1_ms": _round(theirs_b1, 2),
            "b1_speed_relative": theirs_b1 and _round(theirs_b1 / ours_b1, 3),
            "neffkit_b8_tokens_per_s": _round(ours_b8, 1),
            "llamacpp_b8_tokens_per_s": _round(theirs_b8, 1),
            "b8_speed_relative": theirs_b8 and _round(ours_b8 / theirs_b8, 3),
        }
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (models/smollm2-135m-instruct)",
        "llama_cpp": f"{SDIST} vendor/llama.cpp ({COMMIT}), GGML_NATIVE=ON",
        "threads": THREADS,
        "rounds": args.rounds,
        "b8_work": f"{len(PROMPTS)} prompts x (4 tokens + {NEW_TOKENS} new)",
        "rows": rows,
        "greedy_vs_hf": greedy_against_hf(llms, bins["llama-server"], ggufs, failures),
        "llamacpp_failures": failures,
    }
    write_result(args.result, result)  # the offline figures, whatever serving does
    if not args.skip_serve:
        del llms  # the servers load their own copies
        result["serving"] = {
            kind: serving(kind, bundles[kind], bins["llama-server"], ggufs[kind], args)
            for kind in ("float32", "bfloat16")
        }
    print(json.dumps(result, indent=2))
    print(f"written {write_result(args.result, result)}")


if __name__ == "__main__":
    main()
