"""What bench/llamacpp.py runs, made once under bench/work/llamacpp: llama.cpp's programs, the
GGUFs they read and neffkit's bundles of the same checkpoint; and how llama.cpp's programs run.

llama.cpp is built from the tree `llama-cpp-python==0.3.36`'s sdist vendors (`vendor/llama.cpp`,
cmake, `GGML_NATIVE=ON`), and the HF-format checkpoint `make demo` converts goes through its
`convert_hf_to_gguf.py` into f32, bf16 and Q8_0 GGUFs, in a venv of its own (the converter pins
transformers 4.57). neffkit's float32, bfloat16 and block-fp8 bundles come from the same
checkpoint (the fp8 one is also bench/fp8.py's). Everything here is setup, kept apart from the
measurements so that what is timed reads on its own: `run` prints and runs a command, `guarded`
records a llama.cpp program dying by a signal as a result instead of stopping the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle  # noqa: E402

WORK = REPO / "bench" / "work" / "llamacpp"
SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp at commit 0c1e57098 (its CHANGELOG)
COMMIT = "0c1e57098"
MODEL = REPO / "models" / "smollm2-135m-instruct"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server")
THREADS = 2  # both sides, unless --threads says otherwise


def threads() -> int:
    """The threads of both sides: --threads (common.parse_args sets NEFFKIT_ENGINE_THREADS)."""
    return int(os.environ.get("NEFFKIT_ENGINE_THREADS", THREADS))


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


# llama.cpp's CPU flags per class: native takes every ISA extension this host has; avx2 is the
# AVX2 + FMA + F16C class (AMD Zen 1-3, Intel Haswell on) built on any host, as neffkit's
# NEFFKIT_CPU_ISA=avx2 builds its own code
CLASS_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ],
}


def binaries(cpu_class: str = "native") -> dict[str, Path]:
    """llama.cpp's programs built for `cpu_class` (CLASS_FLAGS), once."""
    build = WORK / ("build" if cpu_class == "native" else f"build-{cpu_class}")
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
            *CLASS_FLAGS[cpu_class],
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
