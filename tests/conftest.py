"""Shared fixtures: tiny random HF checkpoints (the oracle) and bundles built from them once per
run. Builds dominate the suite's time (g++ per graph), so every test reuses these bundles.

Under pytest-xdist (`make test` runs two workers) the workers share one directory of models,
bundles and artifact cache: each is made once, by whichever worker asks first, under a file lock
the other waits on. Each family's bundle has as few graphs as its tests need (one decode bucket
unless a test needs a bucket switch).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from neffkit import cpu_kernels

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "models" / "demo-llama"
VOCAB = 1024  # matches the demo tokenizer, so test models can take text prompts

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
)

# the test checkpoints' chat template (transformers >= 4.43 saves it as chat_template.jinja)
CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant: {% endif %}"
)

# kind → (transformers config class, extra config, buckets)
SMALL = {"prefill": [16], "decode": [4], "context": [64]}  # two graphs: one prefill, one decode
# decode [1, 4]: rows move into a smaller bucket (runtime tests); context [32, 64]: a bucket switch
TWO_DECODE = {"prefill": [16], "decode": [1, 4], "context": [64]}
DEEPSEEK: dict[str, Any] = {
    "num_key_value_heads": 4, "moe_intermediate_size": 32, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 32,
                        "rope_theta": 10000.0},
}  # fmt: skip
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, list[int]]]] = {
    # prefill_batch [1, 4]: prompts given together prefill packed, one row each
    "llama": ("LlamaConfig", {}, {"prefill": [16], "decode": [1, 4], "context": [32, 64],
                                  "prefill_batch": [1, 4]}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}, TWO_DECODE),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, SMALL),
    "mistral": ("MistralConfig", {"sliding_window": 24}, SMALL),
    # MQA + qkv bias; a vocabulary tp=2 does not divide: the last vocab shard is padded
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 1, "vocab_size": 1027}, SMALL),
    # layer 0 dense, layer 1 sparse; renormalised top-2 of 8 experts. MoE decode [1, 4]: one row
    # gathers its 2 routed experts (2 < 8), four rows run all 8 densely (8 is not < 8)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
        },
        TWO_DECODE,
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}, TWO_DECODE),
    # rope scaling: frequencies are a graph input, so llama3/linear reuse llama's graphs (cache
    # hits) and only yarn (its attention factor scales cos/sin) compiles its own. The scaled
    # frequencies act well inside the test prompts' positions (original length 32 < 49).
    "llama_rope3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0}}, SMALL),
    "llama_linear": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, SMALL),
    "qwen2_yarn": ("Qwen2Config", {"num_key_value_heads": 1, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}}, SMALL),
    # GPT-OSS: sinks, sliding (window 8 < the test prompts) and full layers, biases, clamped
    # SwiGLU over interleaved gate/up, top-2 of 8 experts, yarn rope as the release has it
    "gpt_oss": ("GptOssConfig", {
        "intermediate_size": 32, "head_dim": 16, "num_local_experts": 8,
        "num_experts_per_tok": 2, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 32, "rope_theta": 10000.0}},
        TWO_DECODE),
    # DeepSeek-V3: MLA (q-LoRA, latent cache, interleaved rope, yarn with mscale_all_dim),
    # a dense first layer, then sigmoid group-limited routing (2 of 4 groups), top-2 of 8
    # experts, a shared expert; decode b1 gathers its routed experts
    "deepseek": ("DeepseekV3Config", DEEPSEEK, TWO_DECODE),
    "deepseek_noq": ("DeepseekV3Config", {**DEEPSEEK, "q_lora_rank": None}, SMALL),
}  # fmt: skip
# kind → manifest fields beyond buckets. llama_tied runs the runtime tests whose rows move
# between sequences and buckets: there, decode reads its tokens from the device state
# (decode_state: device; the other cpu bundles send them from the host, the cpu default), and
# every decode projection goes through neffkit's C++ kernel (cpu_kernel: on; auto leaves the
# test models' small weights to Inductor).
EXTRA: dict[str, dict[str, Any]] = {
    "llama_tied": {
        "decode_state": "device",
        "compiler": {"cpu_kernel": "on" if cpu_kernels.supported() else "off"},
    },
}
# kind → (parallel layout, buckets) of the tp > 1 bundles
PARALLEL: dict[str, tuple[dict[str, int], dict[str, list[int]]]] = {
    "llama": ({"tp": 2}, {"prefill": [16], "decode": [4], "context": [256]}),
    "qwen3": ({"tp": 2}, SMALL),
    "qwen2": ({"tp": 2}, SMALL),  # one KV head: replicated on both ranks
    "qwen3_moe": ({"tp": 2, "ep": 2}, SMALL),
    # ep=2: 4 experts a rank; decode b1 gathers among them, the other rank's slots weigh 0
    "mixtral": ({"tp": 2, "ep": 2}, TWO_DECODE),
    "gpt_oss": ({"tp": 2, "ep": 2}, TWO_DECODE),
    "deepseek": ({"tp": 2, "ep": 2}, TWO_DECODE),
    "deepseek_noq": ({"tp": 2, "ep": 2}, SMALL),  # q_proj's heads split over the ranks
}


# Tests that build bundles (g++ per graph) or start servers are `slow`: `make test-fast` skips them.
SLOW_FIXTURES = {"bundle", "tp_bundle", "serve_bundle", "server", "lowered"}
SLOW_MODULES = {
    "test_build",
    "test_fp8",
    "test_generate",
    "test_neuron",
    "test_parallel",
    "test_runtime",
    "test_server",
    "test_verify",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def run_cli(*args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "neffkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"neffkit {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def run_json(*args: str) -> dict[str, Any]:
    return json.loads(run_cli(*args, "--json", check=True).stdout)


def bundle_json(path: Path) -> dict[str, Any]:
    """bundle.json of a bundle, opened (and every file verified) through the typed record."""
    from neffkit.bundle import read_bundle

    return read_bundle(path).record.to_json()


def session_cache(session_dir: Path) -> Path:
    """One artifact cache for the whole session: rebuilds in tests reuse its entries."""
    return session_dir / "cache"


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the run; xdist workers share it (their basetemps are its siblings)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "neffkit-shared"
    root.mkdir(exist_ok=True)
    return root


@contextmanager
def exclusive(session_dir: Path, name: str) -> Iterator[None]:
    """Hold the run-wide lock `name`: one worker makes a shared thing, the others wait for it."""
    locks = session_dir / "locks"
    locks.mkdir(exist_ok=True)
    with (locks / f"{name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make_hf_model(kind: str, out: Path, seed: int = 0) -> Path:
    import transformers

    config_cls, extra, _ = MODELS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF initialises biases to zero: random ones test their handling
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if "bias" in name and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.2)  # e_score_correction_bias (a buffer) included
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEMO_MODEL / name, out / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # unlike neffkit's default one
    return out


@pytest.fixture(scope="session")
def hf_model_dir(session_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = session_dir / "models" / kind
            with exclusive(session_dir, f"model-{kind}"):
                if not (out / "config.json").exists():
                    make_hf_model(kind, out)
            made[kind] = out
        return made[kind]

    return get


def write_manifest(path: Path, model_dir: Path, **overrides: Any) -> Path:
    data: dict[str, Any] = {
        "neffkit": 1,
        "name": path.stem,
        "model": str(model_dir),
        "kv_cache": {"block_size": 16},
        "buckets": SMALL,
        "sampling": {"max_top_k": 16},
    }
    data.update(overrides)
    path.write_text(yaml.safe_dump(data))
    return path


def build_session_bundle(session_dir: Path, model_dir: Path, name: str, **manifest: Any) -> Any:
    """Write manifest NAME.yaml and build it into bundles/NAME with the run's cache, once per
    run: a later call (from any xdist worker) gets the first build's result back."""
    from neffkit.compile.build import BuildResult, build
    from neffkit.manifest import load_manifest

    report = session_dir / "bundles" / f"{name}.report.json"
    with exclusive(session_dir, f"bundle-{name}"):
        if report.exists():
            data = json.loads(report.read_text())
            return BuildResult(Path(data["bundle"]), counters=data["counters"])
        path = write_manifest(session_dir / f"{name}.yaml", model_dir, **manifest)
        result = build(
            load_manifest(path),
            session_dir / "bundles" / name,
            jobs=build_jobs_per_worker(),
            cache=session_cache(session_dir),
        )
        report.write_text(json.dumps(result.report()))
        return result


def build_jobs_per_worker() -> int:
    """Build workers per test build: the cores shared among the xdist workers."""
    if os.environ.get("NEFFKIT_TEST_JOBS"):
        return int(os.environ["NEFFKIT_TEST_JOBS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    return max(1, (os.cpu_count() or 2) // workers)


@pytest.fixture(scope="session")
def bundle(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Callable[[str], Path]:
    """kind → a bundle built from that kind's tiny checkpoint (built once per session)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            result = build_session_bundle(
                session_dir, hf_model_dir(kind), kind, buckets=MODELS[kind][2],
                **EXTRA.get(kind, {}),
            )  # fmt: skip
            built[kind] = result.bundle
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tp_bundle(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Callable[[str], Any]:
    """kind → the BuildResult of that kind's tp > 1 bundle (built once per session)."""
    built: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in built:
            parallel, buckets = PARALLEL[kind]
            built[kind] = build_session_bundle(
                session_dir,
                hf_model_dir(kind),
                f"{kind}_tp{parallel['tp']}",
                buckets=buckets,
                parallel=parallel,
            )
        return built[kind]

    return get


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[int], int], list[int]]:
    """The oracle: HF transformers greedy generate on the saved checkpoint."""
    import transformers

    models: dict[Path, Any] = {}

    def run(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        if model_dir not in models:
            models[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        ids = torch.tensor([prompt])
        out = models[model_dir].generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        return out[0, len(prompt) :].tolist()

    return run
