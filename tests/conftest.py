"""Shared fixtures: tiny random HF checkpoints (the oracle) and bundles built from them once per
run. Compiles dominate the suite's time (g++ per graph), so every test reuses these bundles, and
every build goes through one persistent, content-addressed test cache (docs/testing.md):

  $NEFFKIT_TEST_CACHE (default ~/.cache/neffkit-test)
    models/<kind>-<digest>/   the test checkpoints, made once per machine; the digest covers
                              everything a checkpoint is made from (config, seed, transformers,
                              the code below), so a changed recipe makes a new one
    artifacts/                neffkit's own artifact cache (compiled graphs, traces, weight
                              shards), keyed by the product's cache keys: an unchanged graph is
                              never compiled twice on one machine

Under pytest-xdist (`make test` runs two workers) the workers share one session directory of
bundles: each is built once, by whichever worker asks first, under a file lock the other waits
on. Each family's bundle has as few graphs as its tests need (one decode bucket unless a test
needs a bucket switch). Tests under tests/e2e/ build bundles or start servers; tests/unit/
builds nothing; `full` tests run only in `make test-all` (docs/testing.md).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from neffkit.platform import cpu_kernels, cpus

# The oracle is transformers' own PyTorch code. From 5.25 on, from_pretrained swaps layers for
# kernels from the Hub unless told not to, and such a model is no longer the reference.
os.environ.setdefault("USE_HUB_KERNELS", "NO")

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
# decode [1, 4]: rows move into a smaller bucket (runtime tests)
TWO_DECODE = {"prefill": [16], "decode": [1, 4], "context": [64]}
# MoE: decode [1] gathers each token's 2 routed experts (2 < 8); prefill runs all 8 densely, the
# code a decode of 4 rows would run too (8 is not < 8); more prompts than rows take turns
ONE_DECODE = {"prefill": [16], "decode": [1], "context": [64]}
DEEPSEEK: dict[str, Any] = {
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    },
}
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, list[int]]]] = {
    # prefill_batch [1, 4]: prompts given together prefill packed, one row each (a context
    # bucket switch: the lowered llama bundle's [32, 64], test_generate)
    "llama": (
        "LlamaConfig",
        {},
        {"prefill": [16], "decode": [1, 4], "context": [64], "prefill_batch": [1, 4]},
    ),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}, TWO_DECODE),
    # GELU (exact erf) and every bias: hidden_act and attention/mlp_bias change the function
    "llama_gelu": (
        "LlamaConfig",
        {"hidden_act": "gelu", "attention_bias": True, "mlp_bias": True},
        SMALL,
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, SMALL),
    "mistral": ("MistralConfig", {"sliding_window": 24}, SMALL),
    # MQA + qkv bias; a vocabulary tp=2 does not divide: the last vocab shard is padded
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 1, "vocab_size": 1027}, SMALL),
    # layer 0 dense, layer 1 sparse; renormalised top-2 of 8 experts (buckets: ONE_DECODE)
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
        ONE_DECODE,
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}, ONE_DECODE),
    # rope scaling: frequencies are a graph input, so llama3/linear reuse llama's graphs (cache
    # hits) and only yarn (its attention factor scales cos/sin) compiles its own. The scaled
    # frequencies act well inside the test prompts' positions (original length 32 < 49).
    "llama_rope3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        },
        SMALL,
    ),
    "llama_linear": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        SMALL,
    ),
    "qwen2_yarn": (
        "Qwen2Config",
        {
            "num_key_value_heads": 1,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        },
        SMALL,
    ),
    # GPT-OSS: sinks, sliding (window 8 < the test prompts) and full layers, biases, clamped
    # SwiGLU over interleaved gate/up, top-2 of 8 experts, yarn rope as the release has it
    "gpt_oss": (
        "GptOssConfig",
        {
            "intermediate_size": 32,
            "head_dim": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        },
        ONE_DECODE,
    ),
    # DeepSeek-V3: MLA (q-LoRA, latent cache, interleaved rope, yarn with mscale_all_dim),
    # a dense first layer, then sigmoid group-limited routing (2 of 4 groups), top-2 of 8
    # experts, a shared expert; decode b1 gathers its routed experts
    "deepseek": ("DeepseekV3Config", DEEPSEEK, ONE_DECODE),
    "deepseek_noq": ("DeepseekV3Config", {**DEEPSEEK, "q_lora_rank": None}, SMALL),
    # Gemma 3: a sliding (window 8) and a full layer with their own rope (default / linear),
    # q/k norms, four norms a layer, sqrt(hidden) embedding scale, query_pre_attn_scalar
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
        SMALL,
    ),
    # Phi-3: fused qkv_proj and gate_up_proj; longrope (short factors: context <= original 64)
    "phi3": (
        "Phi3Config",
        {
            "pad_token_id": 0,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
        },
        SMALL,
    ),
    # Granite: embedding, attention, residual and logit multipliers
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.05,
            "residual_multiplier": 0.22,
            "logits_scaling": 8.0,
        },
        SMALL,
    ),
    # OLMo: weightless LayerNorms and clip_qkv; OLMo 2: norms after, q/k norms over all heads
    "olmo": ("OlmoConfig", {"clip_qkv": 0.5, "pad_token_id": 0}, SMALL),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}, SMALL),
    # Cohere: parallel attention and MLP, LayerNorms, interleaved rope, per-head q/k norms
    "cohere": ("CohereConfig", {"use_qk_norm": True, "logit_scale": 0.5, "pad_token_id": 0}, SMALL),
    # Gemma 2: soft-capped attention scores and logits (caps small enough to bite)
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
        SMALL,
    ),
    # Llama 4: a chunked (8 tokens < the test prompts) RoPE layer with L2 q/k norms and a dense
    # MLP, then a NoPE full layer (temperature-tuned from position 3: floor_scale 4) with top-1
    # sigmoid-routed experts scaling their inputs and a shared expert (buckets: ONE_DECODE)
    "llama4": (
        "Llama4TextConfig",
        {
            "intermediate_size": 32,
            "intermediate_size_mlp": 128,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,
            "no_rope_layers": [1, 0],
            "attention_chunk_size": 8,
            "floor_scale": 4,
            "attn_scale": 0.1,
            "pad_token_id": None,
        },
        ONE_DECODE,
    ),
}
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
    # qwen3 is the CI-shard test's byte-identity reference, so its graphs call none of
    # neffkit's C++ ops: Inductor's code for a graph that calls one differed between an
    # in-process build and a CLI one (the same traced graph, a different fusion), which is not
    # solved yet
    "qwen3": {"compiler": {"cpu_kernel": "off"}},
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
    "phi3": ({"tp": 2}, SMALL),
    "granite": ({"tp": 2}, SMALL),
    "olmo": ({"tp": 2}, SMALL),
    "olmo2": ({"tp": 2}, SMALL),
    "cohere": ({"tp": 2}, SMALL),
    "gemma3": ({"tp": 2}, SMALL),
    "gemma2": ({"tp": 2}, SMALL),
    # ep=2: two experts a rank, each whole; the shared expert and dense MLP split over tp
    "llama4": ({"tp": 2, "ep": 2}, TWO_DECODE),
}


# The shared test prompts (token ids below the test vocabulary) and generation length
SHORT = [5, 6, 7, 8, 9]
LONG = list(range(3, 40))  # 37 tokens: three chunks through the 16-token prefill bucket
MIXED = [[11, 12, 13], list(range(100, 120)), [7, 300, 9, 1000, 2, 55, 66, 77, 88]]
MAX_NEW = 12

E2E = REPO / "tests" / "e2e"


# tests that compile for real on every run (their caches start empty on purpose): scheduled
# first, so the two workers share them instead of one running them at the end
COMPILE_EVERY_RUN = (
    "test_ci_shards_fill_one_s3_cache_and_the_assembly_compiles_nothing",
    "test_killed_builds_leave_nothing_half_written",
    "test_one_rule_change_recompiles_exactly_its_graphs",
    "test_a_changed_checkpoint_is_traced_again",
    "test_build_pack_round_trips_through_run_and_inspect",
    "test_build_with_compiler_compiles_and_caches",
    "test_cluster_build_equals_local_and_survives_a_lost_node",
    "test_per_rank_artifacts_opt_in",
)


def pytest_configure(config: pytest.Config) -> None:
    """A build or run a test starts without naming a cache uses the test cache's, never the
    user's ~/.cache/neffkit (subprocesses inherit these).

    Under xdist, each worker's engines (in this process or a server it starts) take its share of
    the CPUs, as two engines on one host should: with every worker running as many OpenMP
    threads as there are cores, a decode step waits at each parallel region for a thread the
    other worker has preempted: the six speculation and MTP tests that each run 200 requests
    took 121 s of calls on two workers with two threads each, 20 s with one."""
    os.environ.setdefault("NEFFKIT_CACHE", str(cache_root() / "default-cache"))
    os.environ.setdefault("NEFFKIT_BUNDLES", str(cache_root() / "unpacked"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault(cpus.ENV, str(max(1, cpus.usable_cpus() // workers)))
        torch.set_num_threads(int(os.environ[cpus.ENV]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests under tests/e2e/ build bundles or start servers: marked `e2e` by where they are.
    The tests that compile on every run go first (a stable sort keeps the rest in order)."""
    for item in items:
        if E2E in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in COMPILE_EVERY_RUN)


def cache_root() -> Path:
    """The persistent test cache: $NEFFKIT_TEST_CACHE, else ~/.cache/neffkit-test."""
    configured = os.environ.get("NEFFKIT_TEST_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "neffkit-test"


def artifact_cache() -> Path:
    """neffkit's artifact cache inside the test cache: every test build reads and fills it. One
    per compile environment, so the tests that compare fresh compiles with cached ones compare
    bytes made alike."""
    return cache_root() / "artifacts" / environment_digest()


def run_cli(
    *args: str, check: bool = False, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as a user runs it (in `env`, else this process's)."""
    proc = subprocess.run(
        [sys.executable, "-m", "neffkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"neffkit {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def run_json(*args: str) -> dict[str, Any]:
    """The CLI's --json output. `neffkit run` of a one-rank cpu bundle runs in this process
    (click's test runner: the same command, argument parsing to report, without starting a
    Python and torch); everything else, and every test of exit codes and messages, through a
    real subprocess (run_cli)."""
    if _runs_here(args):
        from click.testing import CliRunner

        from neffkit.cli import cli

        result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)
    return json.loads(run_cli(*args, "--json", check=True).stdout)


def _runs_here(args: tuple[str, ...]) -> bool:
    if len(args) < 2 or args[0] != "run" or "--executor" in args:
        return False
    meta = Path(args[1]) / "bundle.json"
    if not meta.is_file():
        return False
    record = json.loads(meta.read_text())
    return record["target"] == "cpu" and record["layout"]["world_size"] == 1


def run_ids(path: Path, prompts: list[list[int]], max_tokens: int = MAX_NEW, *extra: str):
    """`neffkit run` on token-id prompts: each prompt's generated ids, in prompt order."""
    args = ["run", str(path), "--max-tokens", str(max_tokens), *extra]
    for prompt in prompts:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    return [o["token_ids"] for o in run_json(*args)["outputs"]]


def bundle_json(path: Path) -> dict[str, Any]:
    """bundle.json of a bundle, opened (and every file verified) through the typed record."""
    from neffkit.contract.read import read_bundle

    return read_bundle(path).record.to_json()


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
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
            if "norm" in name and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.2)  # Gemma's norms start at 0 (they scale by 1 + w)
    model.save_pretrained(out)
    assert (out / "model.safetensors").exists(), f"{kind}: transformers wrote no weights"
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO_MODEL / name, out / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # unlike neffkit's default one
    return out


@functools.cache
def model_digest(kind: str, seed: int = 0) -> str:
    """Everything a test checkpoint is made from: its config, the seed, transformers' version,
    the tokenizer files, the chat template and the code that makes it."""
    import inspect

    import transformers

    recipe = {
        "config": MODELS[kind][:2],
        "common": COMMON,
        "seed": seed,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "maker": inspect.getsource(make_hf_model),
        "template": CHAT_TEMPLATE,
        "tokenizer": [(DEMO_MODEL / n).read_bytes().hex() for n in TOKENIZER_FILES],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def cached_dir(name: str, make: Callable[[Path], object]) -> Path:
    """cache_root()/NAME, made once per machine by `make(tmp)` and renamed into place, so an
    interrupted run never leaves half a checkpoint behind and concurrent runs agree."""
    out = cache_root() / name
    if (out / ".complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(cache_root(), name.replace("/", "-")):
        if not (out / ".complete").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            try:
                make(tmp)
                (tmp / ".complete").write_text("")
                shutil.rmtree(out, ignore_errors=True)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_dir_name(kind: str) -> str:
    return f"models/{kind}-{model_digest(kind)}"


def make_missing_models() -> None:
    """Every MODELS checkpoint the test cache lacks, made by one process of its own (one import
    of transformers for all): transformers saves nothing in a process whose torch.distributed
    group says rank != 0, and a test worker may hold tracing's fake group."""
    code = (
        "from tests.conftest import MODELS, cached_dir, make_hf_model, model_dir_name\n"
        "for kind in MODELS:\n"
        "    cached_dir(model_dir_name(kind), lambda d, k=kind: make_hf_model(k, d))\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)


@pytest.fixture(scope="session")
def hf_model_dir() -> Callable[[str], Path]:
    """kind → its tiny random HF checkpoint (persistent: see the module docstring)."""

    def get(kind: str) -> Path:
        out = cache_root() / model_dir_name(kind)
        if not (out / ".complete").exists():
            make_missing_models()
        return out

    return get


# The test manifests' sampler: top-k/top-p over 16 candidates, without the inputs only the
# server's tests send (structured outputs' bitmask, penalties, logit bias). Each of those is
# part of every graph (more to trace and compile: a test graph compiles about a third faster
# without them); the bundles whose tests send them (test_server's) ask for them.
LEAN_SAMPLING = {"max_top_k": 16, "structured": False, "max_penalty_tokens": 0, "max_logit_bias": 0}


def write_manifest(path: Path, model_dir: Path, **overrides: Any) -> Path:
    data: dict[str, Any] = {
        "neffkit": 1,
        "name": path.stem,
        "model": str(model_dir),
        "kv_cache": {"block_size": 16},
        "buckets": SMALL,
        "sampling": LEAN_SAMPLING,
    }
    data.update(overrides)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # whole or not at all: workers share it
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)
    return path


def bundle_key(manifest_path: Path, *flags: str) -> str:
    """What a test bundle is made from, in the product's own keys: the early (trace) key of
    every graph on every rank (the resolved manifest, the checkpoint's stamps, neffkit's source,
    torch and lowering versions, the graph) and the build flags. Equal keys, equal bundles
    (builds are deterministic), so a bundle is built once per machine until one of them moves."""
    from neffkit.compile.backends import get_backend
    from neffkit.compile.cache.keys import trace_key
    from neffkit.compile.plan import make_plan
    from neffkit.manifest import load_manifest

    manifest = load_manifest(manifest_path)
    backend = get_backend(manifest.target)
    keys = [
        trace_key(manifest, backend, spec, rank).digest
        for spec in make_plan(manifest).graphs
        for rank in range(manifest.parallel.tp)
    ]
    env = environment_digest()
    return hashlib.sha256(json.dumps([keys, sorted(flags), env]).encode()).hexdigest()[:16]


@functools.cache
def _compiler_version() -> str:
    proc = subprocess.run(["c++", "--version"], capture_output=True, text=True)
    return proc.stdout.splitlines()[0] if proc.returncode == 0 and proc.stdout else "none"


@functools.cache
def environment_digest() -> str:
    """What an artifact's bytes depend on beyond its graph (docs/builds.md, reproducible
    packages): the host the product's own cache keys by, the C++ compiler, and the paths the
    compiled library records (torch's headers, Inductor's cache directory). A test cache carried
    to another machine or venv then builds its bundles again instead of comparing old bytes."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from neffkit.compile.backends import get_backend

    host = get_backend("cpu").host_requirements().to_json()
    env = [host, _compiler_version(), str(Path(torch.__file__).parent), cache_dir()]
    return hashlib.sha256(json.dumps(env).encode()).hexdigest()[:16]


def cached_bundle(
    session_dir: Path,
    name: str,
    manifest_path: Path,
    flags: tuple[str, ...],
    build: Callable[[Path], dict[str, Any]],
) -> tuple[Path, dict[str, Any]]:
    """The bundle NAME of this manifest and flags from the test cache, else built there by
    `build(out)` (which returns the build report), once per machine and published by rename."""
    root = cached_dir(
        f"bundles/{name}-{bundle_key(manifest_path, *flags)}",
        lambda d: (d / "report.json").write_text(json.dumps(build(d / "bundle"))),
    )
    report = json.loads((root / "report.json").read_text())
    return root / "bundle", report


def build_session_bundle(session_dir: Path, model_dir: Path, name: str, **manifest: Any) -> Any:
    """Write manifest NAME.yaml and build it (with the test cache) into a bundle the test cache
    keeps: a later call, from any xdist worker or a later run, gets the first build back."""
    from neffkit.compile.build import BuildResult, build
    from neffkit.manifest import load_manifest

    path = write_manifest(session_dir / f"{name}.yaml", model_dir, **manifest)

    def make(out: Path) -> dict[str, Any]:
        result = build(
            load_manifest(path), out, jobs=build_jobs_per_worker(), cache=artifact_cache()
        )
        return result.report()

    bundle, report = cached_bundle(session_dir, name, path, (), make)
    return BuildResult(bundle, counters=report["counters"])


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
                session_dir,
                hf_model_dir(kind),
                kind,
                buckets=MODELS[kind][2],
                **EXTRA.get(kind, {}),
            )
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


# families whose compiled bundles `make test` builds and compares with HF: they also serve the
# runtime, server, build, fp8 and MLA tests. Every family's model code is compared with HF in
# `make test` with nothing compiled (tests/unit/test_families.py: the graphs a build traces, run
# eagerly); every family's compiled bundle is compared in `make test-all`.
BUNDLES_IN_TEST = ("llama", "llama_tied", "qwen3", "deepseek")
# lowered bundles `make test` builds and runs on XLA:CPU: tp=1 and tp=2, MLA, expert parallelism
LOWERED_IN_TEST = (("llama", 1), ("llama", 2), ("deepseek", 1), ("mixtral", 2))


def full_unless(values: Any, kept: Any) -> list[Any]:
    """pytest params of `values`: those not in `kept` marked `full` (only in `make test-all`)."""
    return [v if v in kept else pytest.param(*_tuple(v), marks=pytest.mark.full) for v in values]


def _tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


TP2_IN_TEST = ("llama",)  # its tp=2 bundle serves the runtime, server and audit tests


# bundles a test module builds for its own tests, registered by `prebuild` for the prebuild:
# name → (builder, its stage)
PREBUILD: dict[str, tuple[Callable[[Path, Callable[[str], Path]], Path], int]] = {}


def prebuild(name: str, stage: int = 0):
    """Register a test module's bundle builder, fn(session_dir, hf_model_dir) → bundle, with the
    prebuild: without it, two workers reaching the module together would both wait on one
    build. `stage` 1: after the shared bundles, whose graphs it shares (cache hits once those
    are built), so no worker compiles them twice side by side; stage 2: after stage 1's."""

    def register(fn: Callable[[Path, Callable[[str], Path]], Path]):
        PREBUILD[name] = (fn, stage)
        return fn

    return register


@pytest.fixture(scope="session", autouse=True)
def prebuilt(session_dir: Path, hf_model_dir, bundle, tp_bundle, lowered) -> None:
    """With NEFFKIT_TEST_PREBUILD=1 (`make test`), every worker starts by building the bundles
    most tests share, each taking the next one no other worker has claimed: builds run side by
    side from the start instead of one worker waiting on the build another started. The test
    modules' own bundles (the largest) go first."""
    if os.environ.get("NEFFKIT_TEST_PREBUILD") != "1":
        return
    own = {
        name: (lambda fn=fn: fn(session_dir, hf_model_dir)) for name, (fn, _) in PREBUILD.items()
    }
    jobs: list[tuple[str, Callable[[], object]]] = [
        (name, own[name]) for name, (_, stage) in PREBUILD.items() if stage == 0
    ]
    jobs += [(kind, lambda k=kind: bundle(k)) for kind in BUNDLES_IN_TEST]
    jobs += [(f"{k}_tp2", lambda k=k: tp_bundle(k)) for k in TP2_IN_TEST]
    jobs += [(f"{k}_neuron_tp{tp}", lambda k=k, tp=tp: lowered(k, tp)) for k, tp in LOWERED_IN_TEST]
    for later in (1, 2):
        jobs += [(name, own[name]) for name, (_, stage) in PREBUILD.items() if stage == later]
    for name, build in jobs:
        with claimed(session_dir, name) as mine:
            if mine:
                build()


@contextmanager
def claimed(session_dir: Path, name: str) -> Iterator[bool]:
    """Claim job NAME for this worker, without waiting: yields False if another holds it."""
    claims = session_dir / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    with (claims / f"{name}.lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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


# ---------------------------------------------------------------- neuron: lowered bundles

NEURON = {"target": "neuron", "neuron": {"target": "trn2", "lnc": 2}}
LOWERED = {  # kind, tp → buckets
    ("llama", 1): {"prefill": [16], "decode": [2], "context": [32, 64]},
    ("qwen3", 1): {"prefill": [16], "decode": [2], "context": [64]},
    ("llama", 2): {"prefill": [16], "decode": [2], "context": [64]},
    ("qwen3", 2): {"prefill": [16], "decode": [2], "context": [64]},
    # sinks, sliding + full layers, yarn, biases; decode b1 gathers its routed experts
    ("gpt_oss", 1): {"prefill": [16], "decode": [1], "context": [64]},
    # MLA: latent cache, expanded prefill, absorbed decode; grouped routing, shared expert;
    # packed prefill (two prompts' tokens in one row, per-token sequence ids)
    ("deepseek", 1): {"prefill": [16], "decode": [1], "context": [64], "prefill_batch": [1, 2]},
    # experts over 2 groups (ep=2), each expert's intermediate dimension whole (tp/ep = 1)
    ("mixtral", 2): {"prefill": [16], "decode": [2], "context": [64]},
    # Gemma 3: two rotations, q/k norms, scaled embedding, sliding + full layers
    ("gemma3", 1): {"prefill": [16], "decode": [2], "context": [64]},
    # OLMo 2 at tp=2: its q/k norms all-reduce their sums of squares over the ranks
    ("olmo2", 2): {"prefill": [16], "decode": [2], "context": [64]},
    # Llama 4: chunked and NoPE layers, sigmoid top-1 routing into input-scaled experts
    ("llama4", 1): {"prefill": [16], "decode": [1], "context": [64]},
}
EP = {"mixtral": 2}  # kind → ep at tp > 1


def lowered_build(
    session_dir: Path, model_dir: Path, name: str, *extra: str, **manifest: Any
) -> Path:  # NEURON's chip unless `neuron` is given
    """A neuron build of `model_dir` (`neffkit build ... EXTRA`): from the test cache, where
    traces and their HLO are cached like artifacts, and kept there as a bundle; with
    `--no-cache` in EXTRA, built afresh into the session directory."""
    path = write_manifest(session_dir / f"{name}.yaml", model_dir, **{**NEURON, **manifest})
    if "--no-cache" in extra:
        out = session_dir / "bundles" / name
        run_cli("build", str(path), "-o", str(out), *extra, check=True)
        return out

    def make(out: Path) -> dict[str, Any]:
        args = ("build", str(path), "-o", str(out), "--cache", str(artifact_cache()), "-j", "1")
        args += extra
        return json.loads(run_cli(*args, "--json", check=True).stdout)

    return cached_bundle(session_dir, name, path, extra, make)[0]


@pytest.fixture(scope="session")
def lowered(session_dir: Path, hf_model_dir: Callable[[str], Path]) -> Callable[..., Path]:
    """(kind, tp) → a lowered neuron bundle, built once per session with --verify."""
    built: dict[tuple[str, int], Path] = {}

    def get(kind: str, tp: int = 1) -> Path:
        if (kind, tp) not in built:
            name = f"{kind}_neuron_tp{tp}"
            parallel = {"tp": tp, "ep": EP.get(kind, 1) if tp > 1 else 1}
            built[(kind, tp)] = lowered_build(
                session_dir,
                hf_model_dir(kind),
                name,
                "--lower-only",
                "--verify",
                buckets=LOWERED[(kind, tp)],
                parallel=parallel,
            )
        return built[(kind, tp)]

    return get
