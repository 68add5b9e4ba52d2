"""Malformed manifests: exit 2, a message naming the field, no traceback, no output directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from neffkit.manifest import load_manifest
from tests.support import REPO
from tests.support.cli import run_cli

VALID = {
    "neffkit": 1,
    "model": "MODEL",
    "kv_cache": {"block_size": 16, "num_blocks": 20},
    "buckets": {"prefill": [16, 32], "decode": [1, 4], "context": [64]},
}


EMBED = {
    "neffkit": 1,
    "model": "MODEL",
    "task": "embed",
    "buckets": {"prefill": [16], "context": [64]},
}


def _with(path: str, value):
    data = yaml.safe_load(yaml.safe_dump(VALID))
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


_DELETE = object()

# (description, manifest data, text the error must contain)
BAD = [
    (
        "string bucket",
        _with("buckets.decode", [1, "auto"]),
        "buckets.decode[1]: expected a positive int, got 'auto'",
    ),
    (
        "negative bucket",
        _with("buckets.decode", [1, -4]),
        "buckets.decode[1]: expected a positive int, got -4",
    ),
    (
        "unsorted buckets",
        _with("buckets.prefill", [32, 16]),
        "buckets.prefill[1]: buckets must be sorted",
    ),
    ("duplicate buckets", _with("buckets.decode", [1, 1]), "buckets.decode[1]"),
    (
        "prefill_batch without 1",
        _with("buckets.prefill_batch", [4, 8]),
        "buckets.prefill_batch[0]: 4; the list must start with 1",
    ),
    (
        "prefill_batch not ints",
        _with("buckets.prefill_batch", [1, "x"]),
        "buckets.prefill_batch[1]: expected a positive int",
    ),
    ("empty buckets", _with("buckets.context", []), "buckets.context: expected a non-empty list"),
    ("missing buckets", _with("buckets", _DELETE), "buckets: required field is missing"),
    (
        "missing decode",
        _with("buckets.decode", _DELETE),
        "buckets.decode: required field is missing",
    ),
    ("unknown top-level key", _with("colour", "blue"), "colour: unknown key"),
    ("unknown nested key", _with("kv_cache.blocksize", 16), "kv_cache.blocksize: unknown key"),
    ("wrong dtype", _with("dtype", "float8"), "dtype: unknown value 'float8'"),
    (
        "wrong target",
        _with("target", "nueron"),
        "target: unknown value 'nueron'; available: cpu, cuda, neuron",
    ),
    ("missing model", _with("model", _DELETE), "model: required field is missing"),
    ("model dir absent", _with("model", "does/not/exist"), "model: directory"),
    ("model not a string", _with("model", 42), "model: expected a path"),
    (
        "prefill not multiple of block",
        _with("buckets.prefill", [24]),
        "buckets.prefill[0]: 24 is not a multiple of kv_cache.block_size (16)",
    ),
    ("too few kv blocks", _with("kv_cache.num_blocks", 4), "kv_cache.num_blocks: 4 blocks"),
    (
        "kv blocks twice",
        _with("kv_cache", {"num_blocks": 9, "memory_mb": 1}),
        "kv_cache: give num_blocks or memory_mb, not both",
    ),
    ("kv memory too small", _with("kv_cache.memory_mb", 0), "kv_cache.memory_mb: expected a"),
    (
        "prefix caching not a bool",
        _with("kv_cache.prefix_caching", "yes"),
        "kv_cache.prefix_caching: expected true or false, got 'yes'",
    ),
    (
        "bad block size",
        _with("kv_cache.block_size", 0),
        "kv_cache.block_size: expected a positive int, got 0",
    ),
    (
        "ep does not divide tp",
        _with("parallel", {"tp": 2, "ep": 3}),
        "parallel.ep: 3 must divide parallel.tp (2)",
    ),
    (
        "tp does not divide heads",
        _with("parallel", {"tp": 3}),
        "parallel.tp: 3 does not divide the model's 4 attention heads",
    ),
    ("schema version", _with("neffkit", 2), "neffkit: unsupported manifest schema 2"),
    (
        "inductor option not allowed",
        _with("compiler", {"inductor": {"freezing": True}}),
        "compiler.inductor.freezing: not an allowed AOTInductor option",
    ),
    (
        "wrapper opt level",
        _with("compiler", {"inductor": {"aot_inductor.compile_wrapper_opt_level": "O9"}}),
        "compiler.inductor.aot_inductor.compile_wrapper_opt_level: unknown value 'O9'; "
        "available: O0, O1, O2, O3, Os",
    ),
    (
        "per_graph bad phase",
        _with("compiler", {"per_graph": [{"match": {"phase": "both"}}]}),
        "compiler.per_graph[0].match.phase: unknown value 'both'",
    ),
    (
        "cpu kernel mode",
        _with("compiler", {"cpu_kernel": "yes"}),
        "compiler.cpu_kernel: unknown value 'yes'; available: auto, on, off",
    ),
    ("decode state", _with("decode_state", "gpu"), "decode_state: unknown value 'gpu'"),
    (
        "kv calibration without an fp8 cache",
        _with("kv_cache", {"calibrate": True}),
        "kv_cache.calibrate: only an fp8 cache has scales to calibrate",
    ),
    (
        "kv calibration not a bool",
        _with("kv_cache", {"dtype": "float8_e4m3fn", "calibrate": "yes"}),
        "kv_cache.calibrate: expected true or false, got 'yes'",
    ),
    (
        "key rotation without an fp8 cache",
        _with("kv_cache", {"rotate_keys": False}),
        "kv_cache.rotate_keys: only an fp8 cache has keys to rotate",
    ),
    (
        "key rotation without calibrated scales",
        _with("kv_cache", {"dtype": "float8_e4m3fn", "calibrate": False, "rotate_keys": True}),
        "kv_cache.rotate_keys: rotated keys need scales calibrated on them",
    ),
    (
        "key rotation not a bool",
        _with("kv_cache", {"dtype": "float8_e4m3fn", "rotate_keys": 1}),
        "kv_cache.rotate_keys: expected true or false, got 1",
    ),
    (
        "fp8 head on an unquantized checkpoint",
        _with("lm_head", {"dtype": "float8_e4m3fn"}),
        "lm_head.dtype: float8_e4m3fn needs an fp8 checkpoint",
    ),
    (
        "head dtype",
        _with("lm_head", {"dtype": "int8"}),
        "lm_head.dtype: 'int8' is not supported; supported: float8_e4m3fn",
    ),
    ("head key", _with("lm_head", {"bits": 8}), "lm_head.bits: unknown key; allowed here: dtype"),
    (
        "flags not strings",
        _with("compiler", {"flags": ["-O2", 3]}),
        "compiler.flags[1]: expected a string, got 3",
    ),
    (
        "neuron block on cpu",
        _with("neuron", {"target": "trn2"}),
        "neuron: only valid with target: neuron",
    ),
    ("top-level not a mapping", ["just", "a", "list"], "manifest: expected a mapping"),
    (
        "draft without a model",
        _with("speculation", {"method": "draft"}),
        "speculation.model: required for method draft",
    ),
    (
        "prompt lookup with a draft",
        _with("speculation", {"method": "draft", "model": "x", "prompt_lookup_min": 2}),
        "speculation.prompt_lookup_min: only for method ngram, not draft",
    ),
    (
        "a draft model with ngram",
        _with("speculation", {"method": "ngram", "model": "x"}),
        "speculation.model: only for method draft, not ngram",
    ),
    (
        "mtp on a checkpoint without MTP layers",
        _with("speculation", {"method": "mtp"}),
        "speculation.method: mtp needs a DeepSeek-V3 checkpoint with multi-token prediction "
        "layers; this one is LlamaForCausalLM",
    ),
    (
        "a model with mtp",
        _with("speculation", {"method": "mtp", "model": "x"}),
        "speculation.model: only for method draft, not mtp",
    ),
    (
        "draft directory missing",
        _with("speculation", {"method": "draft", "model": "no/such/draft/dir"}),
        "speculation.model: directory",
    ),
    (
        "max_batch below every decode bucket",
        _with("buckets.decode", [2, 4]) | {"speculation": {"method": "ngram", "max_batch": 1}},
        "speculation.max_batch: 1 is below the smallest decode bucket (2)",
    ),
    ("lora unknown key", _with("lora", {"rank": 8}), "lora.rank: unknown key"),
    ("lora rank 0", _with("lora", {"max_rank": 0}), "lora.max_rank: expected a positive int"),
    ("lora too many slots", _with("lora", {"max_loras": 65}), "lora.max_loras: 65 is above"),
    (
        "lora target not a projection",
        _with("lora", {"targets": ["q_proj", "lm_head"]}),
        "lora.targets[1]: 'lm_head' is not a projection of LlamaForCausalLM",
    ),
    ("unknown task", _with("task", "classify"), "task: unknown value 'classify'"),
    (
        "embedding without task embed",
        _with("embedding", {"pooling": "mean"}),
        "embedding: only an embed manifest pools hidden states",
    ),
    (
        "embed with decode buckets",
        _with("task", "embed"),
        "buckets.decode: an embed bundle has prefill graphs only",
    ),
    (
        "embed with sampling",
        {**EMBED, "sampling": {"max_top_k": 8}},
        "sampling: an embed bundle generates no tokens",
    ),
    (
        "embed with an unknown pooling",
        {**EMBED, "embedding": {"pooling": "max"}},
        "embedding.pooling: unknown value 'max'; available: last, mean, cls",
    ),
    (
        "embed with prefix caching",
        {**EMBED, "kv_cache": {"prefix_caching": True}},
        "kv_cache.prefix_caching: an embedding pools the states of every token",
    ),
]


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> Path:
    return hf_model_dir("llama")


def _write(tmp_path: Path, data, model_dir: Path) -> Path:
    if isinstance(data, dict) and data.get("model") == "MODEL":
        data = {**data, "model": str(model_dir)}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("desc,data,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_manifest_exits_2_naming_the_field(desc, data, expected, tmp_path, model_dir):
    path = _write(tmp_path, data, model_dir)
    out = tmp_path / "out"
    proc = run_cli("build", str(path), "-o", str(out))
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m.yaml"]  # no staging dir left behind


def test_unsupported_architecture_is_refused_by_name(tmp_path, model_dir):
    import json
    import shutil

    bad_model = tmp_path / "gpt2"
    shutil.copytree(model_dir, bad_model)
    cfg = json.loads((bad_model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad_model / "config.json").write_text(json.dumps(cfg))
    path = _write(tmp_path, {**VALID, "model": str(bad_model)}, model_dir)
    proc = run_cli("build", str(path), "-o", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "architecture 'GPT2LMHeadModel' is not supported" in proc.stderr


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"rope_type": "su", "rope_theta": 1e4},
            "rope_parameters.rope_type = 'su' is not implemented",
        ),
        # HF recomputes these from the longest sequence seen: not static past the bound
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic NTK rope recomputes"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 16,
            },
            "longrope switches",
        ),
    ],
)
def test_rope_types_that_cannot_be_static_are_refused(tmp_path, model_dir, rope, message):
    import json
    import shutil

    bad_model = tmp_path / "rope"
    shutil.copytree(model_dir, bad_model)
    cfg = json.loads((bad_model / "config.json").read_text())
    cfg["rope_parameters"] = rope
    cfg["max_position_embeddings"] = 16  # below the manifest's largest context bucket
    (bad_model / "config.json").write_text(json.dumps(cfg))
    path = _write(tmp_path, {**VALID, "model": str(bad_model)}, model_dir)
    proc = run_cli("build", str(path))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_missing_manifest_file(tmp_path):
    proc = run_cli("build", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "manifest file not found" in proc.stderr


def test_defaults_and_relative_model_path(tmp_path, model_dir):
    data = {
        "neffkit": 1,
        "model": "../" + model_dir.parent.name + "/" + model_dir.name,
        "buckets": {"prefill": [16], "decode": [1, 2], "context": [32]},
    }
    sub = model_dir.parent.parent / "manifests"
    sub.mkdir(exist_ok=True)
    path = sub / "rel.yaml"
    path.write_text(yaml.safe_dump(data))
    m = load_manifest(path)
    assert m.model == model_dir.resolve()
    assert (m.name, m.dtype, m.target) == ("rel", "float32", "cpu")
    assert (m.parallel.tp, m.parallel.ep) == (1, 1)
    # largest context x largest decode bucket, plus the null block
    assert m.kv_cache.num_blocks == 32 * 2 // 16 + 1
    assert m.kv_cache.prefix_caching  # on unless the manifest says false
    assert m.model_config.num_kv_heads == 2


def test_kv_memory_budget_sizes_num_blocks_by_the_cache_width(tmp_path, model_dir):
    """kv_cache.memory_mb: as many blocks as the per-rank budget holds; an fp8 cache (1 byte a
    value) gets twice the blocks of a bfloat16 one in the same memory."""
    base = {
        "neffkit": 1,
        "model": "MODEL",
        "dtype": "bfloat16",
        "buckets": {"prefill": [16], "decode": [1], "context": [32]},
    }
    blocks = {}
    for kv_dtype in ("bfloat16", "float8_e4m3fn"):
        kv = {"memory_mb": 1, **({"dtype": kv_dtype} if kv_dtype != "bfloat16" else {})}
        m = load_manifest(_write(tmp_path, {**base, "kv_cache": kv}, model_dir))
        cfg = m.model_config
        width = 2 if kv_dtype == "bfloat16" else 1
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * width
        assert m.kv_cache.num_blocks == 2**20 // (16 * per_token)
        blocks[kv_dtype] = m.kv_cache.num_blocks
    assert blocks["float8_e4m3fn"] == 2 * blocks["bfloat16"]


@pytest.mark.parametrize("path", sorted((REPO / "manifests").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_manifests_are_valid(path):
    """Every manifest in manifests/ loads against its shipped checkpoint (models/); SmolLM2's
    checkpoint is converted by `make demo` (its layer-skip draft by tools/draft_from_layers.py),
    and until then its manifests name the missing directory."""
    from neffkit.errors import ManifestError
    from neffkit.manifest import load_manifest

    converted = REPO / "models" / "smollm2-135m-instruct"
    if "models/smollm2-135m-instruct" in path.read_text() and not converted.is_dir():
        with pytest.raises(ManifestError, match="smollm2-135m-instruct does not exist"):
            load_manifest(path)
        return
    draft = REPO / "models" / "smollm2-135m-instruct-draft6"  # tools/draft_from_layers.py makes it
    if draft.name in path.read_text() and not draft.is_dir():
        with pytest.raises(ManifestError, match="speculation.model: directory .*draft6"):
            load_manifest(path)
        return
    manifest = load_manifest(path)
    assert manifest.model.is_dir() and manifest.model_config.vocab_size > 0


def test_mla_options_only_for_latent_attention(tmp_path, model_dir):
    path = _write(tmp_path, {**VALID, "mla": {"decode": "expanded"}}, model_dir)
    proc = run_cli("build", str(path))
    assert proc.returncode == 2 and "mla: the model" in proc.stderr, proc.stderr


def test_bare_on_off_are_read_as_cpu_kernel_modes(tmp_path, model_dir):
    """YAML 1.1 reads `cpu_kernel: off` as a boolean; it means the mode a user wrote."""
    from neffkit.manifest import load_manifest

    for text, mode in (("off", "off"), ("on", "on"), ("auto", "auto")):
        path = tmp_path / "m.yaml"
        path.write_text(
            f"neffkit: 1\nmodel: {model_dir}\nbuckets: {{prefill: [16], decode: [1], "
            f"context: [32]}}\ncompiler: {{cpu_kernel: {text}}}\n"
        )
        assert load_manifest(path).compiler.cpu_kernel == mode


def _with_config(tmp_path: Path, model_dir: Path, **fields) -> Path:
    """A copy of the test checkpoint with config.json fields replaced."""
    import json
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **fields}))
    return copy


@pytest.mark.parametrize(
    ("buckets", "config", "message", "hint"),
    [
        (  # the test checkpoint declares max_position_embeddings 256
            {"prefill": [16], "decode": [1], "context": [64, 512]},
            {},
            "buckets.context[1]: 512 exceeds the model's maximum length 256: "
            "max_position_embeddings (256) in ",
            "hint: keep context buckets <= 256, or set buckets.allow_long_context: true",
        ),
        (  # yarn extends it: original 32 x factor 16 = 512
            {"prefill": [16], "decode": [1], "context": [1024]},
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 16.0,
                    "rope_theta": 1e4,
                    "original_max_position_embeddings": 32,
                }
            },
            "buckets.context[0]: 1024 exceeds the model's maximum length 512: "
            "original_max_position_embeddings (32) x rope factor 16.0 (yarn)",
            "hint: keep context buckets <= 512",
        ),
        (  # a prefill bucket no context bucket can hold would build no graph
            {"prefill": [16, 128], "decode": [1], "context": [64]},
            {},
            "buckets.prefill[1]: 128 exceeds the largest context bucket (64); no graph could "
            "be built for it",
            "hint: drop it, or add a context bucket of at least 128",
        ),
    ],
    ids=["max_position_embeddings", "yarn", "prefill_over_context"],
)
def test_buckets_no_graph_can_honour_are_refused(
    tmp_path, model_dir, buckets, config, message, hint
):
    """`neffkit inspect MANIFEST` (validation, no build): exit 2 naming the bucket, the field and
    both numbers, with a hint; nothing is silently built past the model's length or dropped."""
    model = _with_config(tmp_path, model_dir, **config) if config else model_dir
    data = {"neffkit": 1, "model": str(model), "buckets": buckets}
    proc = run_cli("inspect", str(_write(tmp_path, data, model_dir)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {message}" in proc.stderr and hint in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_allow_long_context_is_an_explicit_strict_override(tmp_path, model_dir):
    """buckets.allow_long_context: true builds past max_position_embeddings; anything but a
    boolean is refused like every other field."""
    from neffkit.errors import ManifestError

    buckets = {"prefill": [16], "decode": [1], "context": [512]}
    data = {"neffkit": 1, "model": "MODEL", "buckets": {**buckets, "allow_long_context": True}}
    manifest = load_manifest(_write(tmp_path, data, model_dir))
    assert manifest.max_model_len == 512 and manifest.buckets.allow_long_context
    data["buckets"]["allow_long_context"] = "yes"
    with pytest.raises(ManifestError, match="buckets.allow_long_context: expected true or false"):
        load_manifest(_write(tmp_path, data, model_dir))


def test_speculation_that_builds_no_verify_graph_is_refused(tmp_path, model_dir):
    from neffkit.errors import ManifestError

    data = {
        "neffkit": 1,
        "model": "MODEL",
        "speculation": {"method": "ngram", "max_batch": 2},
        "buckets": {"prefill": [16], "decode": [4, 8], "context": [64]},
    }
    with pytest.raises(ManifestError) as err:
        load_manifest(_write(tmp_path, data, model_dir))
    assert err.value.message.startswith(
        "speculation.max_batch: 2 is below the smallest decode bucket (4); no verify graph"
    )
    assert err.value.hint


def test_a_draft_model_must_share_the_vocabulary_and_run_on_one_rank(tmp_path, hf_model_dir):
    """qwen2's test checkpoint has 1027 tokens, llama's 1024; a draft at tp 2 is refused."""
    other = {"method": "draft", "model": str(hf_model_dir("qwen2"))}
    path = _write(tmp_path, {**VALID, "speculation": other}, hf_model_dir("llama"))
    proc = run_cli("build", str(path), "-o", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "speculation.model: the draft's vocabulary (1027 tokens" in proc.stderr
    assert "differs from the target's (1024)" in proc.stderr and "hint:" in proc.stderr
    same = {"method": "draft", "model": str(hf_model_dir("llama"))}
    data = {**VALID, "speculation": same, "parallel": {"tp": 2}}
    path = _write(tmp_path, data, hf_model_dir("llama"))
    proc = run_cli("build", str(path), "-o", str(tmp_path / "out"))
    assert proc.returncode == 2 and "a draft proposer runs on one rank" in proc.stderr
    manifest = load_manifest(
        _write(tmp_path, {**VALID, "speculation": same}, hf_model_dir("llama"))
    )
    assert manifest.speculation.model == hf_model_dir("llama").resolve()
    assert manifest.to_json()["speculation"]["model"] == str(hf_model_dir("llama").resolve())


def test_lora_targets_follow_the_architecture(model_dir):
    """Every projection of a dense model by default; a mixture of experts' attention only, its
    expert projections refused by name; architectures without adapter graphs refused."""
    import dataclasses

    from neffkit.errors import ManifestError
    from neffkit.manifest.lora import read_lora
    from neffkit.models.registry import read_model_config

    dense = read_model_config(model_dir)
    lora = read_lora({}, dense)
    assert lora is not None and (lora.max_loras, lora.max_rank) == (4, 16)
    assert lora.targets[-1] == "down_proj" and len(lora.targets) == 7
    moe = dataclasses.replace(dense, architecture="MixtralForCausalLM")
    assert read_lora({"max_rank": 8}, moe).targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(
        ManifestError, match=r"lora.targets\[1\]: 'up_proj' is an expert projection"
    ):
        read_lora({"targets": ["q_proj", "up_proj"]}, moe)
    gemma = dataclasses.replace(dense, architecture="Gemma3ForCausalLM")
    with pytest.raises(ManifestError, match="lora: adapters are not supported for Gemma3"):
        read_lora({"max_loras": 2}, gemma)
