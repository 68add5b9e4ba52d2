"""The neuron target: lowering to HLO, its proof on XLA:CPU, and everything up to neuronx-cc.

neuronx-cc cannot run here: `tests/tools/neuronx-cc` stands in for the binary (it writes a
NEFF-shaped file with the documented header) so that argv, parallel runs, logs, exit-code mapping,
header records and the loader's header checks are tested for real around it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from neffkit.contract.bundle import read_zst_text
from neffkit.contract.neff import (
    HEADER_SIZE,
    NeffError,
    compatibility_problems,
    pack_header,
    parse_header,
)
from neffkit.contract.read import read_bundle
from tests.support import REPO
from tests.support.bundles import LOWERED, LOWERED_IN_TEST, NEURON, full_unless
from tests.support.cache import artifact_cache
from tests.support.cli import bundle_json, run_cli
from tests.support.models import write_manifest

STAND_IN = REPO / "tests" / "tools" / "neuronx-cc"


def _alias_params(hlo_text: str) -> list[int]:
    header = hlo_text.splitlines()[0]
    return [int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}, may-alias\)", header)]


@pytest.mark.parametrize(("kind", "tp"), full_unless(LOWERED, LOWERED_IN_TEST))
def test_lowered_bundle_aliases_every_layer_and_is_spmd(lowered, kind: str, tp: int) -> None:
    bundle = read_bundle(lowered(kind, tp))
    data = bundle.record.to_json()
    assert data["stage"] == "lowered" and data["neuron"] == {"target": "trn2", "lnc": 2}
    for g in data["graphs"]:
        assert g["artifact"] is None and g["ranks"] == "all"  # one HLO module serves every rank
        assert g["projection"] == "dot"  # the TensorEngine's form, never the fused reduction
        names = [i["name"] for i in g["inputs"]]
        params = _alias_params(read_zst_text(bundle.path(g["hlo_text"])))
        aliased = sorted(names[p] for p in params)
        # every layer's cache tensors: K and V, or (MLA) the one latent tensor
        # and the decode state (neuron's default decode_state: device)
        layout = bundle.record.layout
        assert layout.state_names == ["last_tokens"]
        assert aliased == sorted(layout.kv_names + layout.state_names), g["name"]
        assert bundle.path(g["hlo"]).read_bytes()  # the proto neuronx-cc reads
        # index math stays in integers: no float64 (Trainium has none) anywhere in the module
        assert not re.search(r"\bf64\[", read_zst_text(bundle.path(g["hlo_text"])))
        if tp > 1:
            assert "all-reduce(" in read_zst_text(bundle.path(g["hlo_text"]))
        # tp > 1: every rank at once over host devices, against the tp=1 eager model
        assert g["verify"]["ok"] and g["verify"]["tokens_equal"], g["verify"]
        devices = f"{tp} host devices" if tp > 1 else "(HLO)"
        assert g["verify"]["executor"].startswith("xla-cpu") and devices in g["verify"]["executor"]


@pytest.mark.parametrize(("kind", "tp"), full_unless(LOWERED, LOWERED_IN_TEST))
def test_own_graphs_pass_the_hlo_rules(lowered, kind: str, tp: int) -> None:
    """The HLO rules (NK30x) on what neuronx-cc would read: no errors on neffkit's own graphs,
    only the informational opcode note. (Before them, an ep=2 MoE lowered `rank // moe_tp`
    through f64 and gathered experts at an unclamped rank offset, and prefill gathered at an
    unclamped last_token_index.)"""
    findings = json.loads(run_cli("inspect", str(lowered(kind, tp)), "--json").stdout)["findings"]
    hlo = [f for f in findings if f["rule"].startswith("NK30")]
    assert [f for f in hlo if f["severity"] != "info"] == []
    assert {f["rule"] for f in hlo} == {"NK305"}


def test_ranks_lower_to_identical_hlo(session_dir: Path, hf_model_dir) -> None:
    """What the build's SPMD check compares for the neuron target, checked directly."""
    from neffkit.compile.backends.neuron.lower import lower_program
    from neffkit.compile.layout import target_layout
    from neffkit.compile.plan import make_plan
    from neffkit.compile.trace import trace_graph
    from neffkit.manifest import load_manifest

    path = write_manifest(
        session_dir / "qwen3_spmd.yaml",
        hf_model_dir("qwen3"),
        **NEURON,
        buckets=LOWERED[("qwen3", 2)],
        parallel={"tp": 2},
    )
    manifest = load_manifest(path)
    layout = target_layout(manifest)
    spec = make_plan(manifest).graphs[-1]
    shas = []
    for rank in (0, 1):
        traced = trace_graph(layout, spec, rank)
        shas.append(
            lower_program(
                traced.program, [s.name for s in traced.inputs], traced.io_alias, 2
            ).sha256
        )
    assert shas[0] == shas[1]


@pytest.mark.parametrize(
    ("kind", "tp"),
    full_unless(
        [
            ("llama", 1),
            ("gpt_oss", 1),
            ("gemma3", 1),
            ("gemma3", 2),
            ("deepseek", 1),
            ("llama4", 1),
            ("llama", 2),
            ("mixtral", 2),
        ],
        LOWERED_IN_TEST,
    ),
)
def test_run_on_xla_cpu_matches_hf_greedy(lowered, hf_model_dir, hf_greedy, kind, tp) -> None:
    """tp=2 (and tp=2 ep=2): the one HLO module runs as SPMD over two host devices in one
    process, each rank's shard on its device, the all-reduces executed by XLA."""
    prompts = [[5, 17, 300, 42, 7], list(range(3, 23))]  # the second spans two prefill chunks
    args = [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    proc = run_cli(
        "run",
        str(lowered(kind, tp)),
        "--executor",
        "xla-cpu",
        *args,
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
        check=True,
    )
    outputs = json.loads(proc.stdout)["outputs"]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out["token_ids"] == hf_greedy(hf_model_dir(kind), prompt, 12)


def test_lowered_bundle_refuses_the_neuron_executor(lowered) -> None:
    proc = run_cli("run", str(lowered("llama")), "--prompt-ids", "1,2,3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "lowered only" in proc.stderr and "--executor xla-cpu" in proc.stderr


def test_neuron_build_without_compiler_points_to_lower_only(session_dir, hf_model_dir) -> None:
    path = write_manifest(session_dir / "nocc.yaml", hf_model_dir("llama"), **NEURON)
    env = {k: v for k, v in os.environ.items() if k != "NEFFKIT_NEURONX_CC"}
    proc = subprocess.run(
        [sys.executable, "-m", "neffkit", "build", str(path), "-o", str(session_dir / "nocc")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "neuronx-cc" in proc.stderr and "--lower-only" in proc.stderr
    assert not (session_dir / "nocc").exists()


def test_missing_lowering_extra_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['torch_mlir'] = None\n"
        "from neffkit.compile.backends import get_backend\n"
        "from neffkit.errors import NeffkitError\n"
        "try:\n    get_backend('neuron')\nexcept NeffkitError as e:\n    print(e.message, e.hint)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert "torch_mlir" in out and "neffkit[lower]" in out


def test_lower_only_is_refused_for_cpu_targets(session_dir, hf_model_dir) -> None:
    path = write_manifest(session_dir / "cpu_lower.yaml", hf_model_dir("llama"))
    proc = run_cli("build", str(path), "--lower-only")
    assert proc.returncode == 2 and "--lower-only applies to target: neuron" in proc.stderr


# ---------------------------------------------------------------- neuronx-cc, through a stand-in


def _compile(bundle: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "neffkit", "compile", str(bundle), "-o", str(out), "-j", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "NEFFKIT_NEURONX_CC": str(STAND_IN), **env},
    )


def test_compile_finishes_a_lowered_bundle(lowered, tmp_path: Path) -> None:
    out = tmp_path / "compiled"
    proc = _compile(lowered("llama"), out)
    assert proc.returncode == 0, proc.stderr
    data = bundle_json(out)  # every file re-hashed
    assert data["stage"] == "compiled"
    for g in data["graphs"]:
        stem = g["name"]
        argv = g["compiler"]["argv"]
        assert argv[:11] == [
            "neuronx-cc",
            "compile",
            f"ir/{stem}.hlo.pb",
            "--framework",
            "XLA",
            "--target",
            "trn2",
            "--logical-nc-config",
            "2",
            "--output",
            f"graphs/{stem}.neff",
        ]
        assert argv[11:] == g["flags"]
        assert "stand-in" in g["compiler"]["version"]
        assert "stand-in neuronx-cc: compile" in (out / g["compiler"]["log"]).read_text()
        header = g["artifact_metadata"]["neff_header"]
        assert header["lnc_size"] == 2 and header["name"] == stem
    # the compiled bundle is what inspect reads: NEFF headers shown
    report = json.loads(run_cli("inspect", str(out), "--json", check=True).stdout)
    assert all(g.get("neff_header", {}).get("lnc_size") == 2 for g in report["graphs"])
    # and the loader gets past the header checks to the Neuron runtime, which is absent here
    proc = run_cli("run", str(out), "--prompt-ids", "1,2,3")
    assert proc.returncode == 2 and "Neuron runtime" in proc.stderr, proc.stderr


def test_loader_refuses_a_neff_built_for_another_lnc(lowered, tmp_path: Path) -> None:
    out = tmp_path / "lnc1"
    assert _compile(lowered("llama"), out, FAKE_NEFF_LNC="1").returncode == 0
    proc = run_cli("run", str(out), "--prompt-ids", "1,2,3")
    assert proc.returncode == 2 and "compiled for lnc=1, the runtime uses lnc=2" in proc.stderr


OOM = ({"FAKE_NEURONX_CC_SIGNAL": str(int(signal.SIGKILL))}, "out-of-memory")


# each failure's explanation is a unit test (tests/unit/test_neuronx_cc.py); through the CLI,
# `make test` runs one
@pytest.mark.parametrize(
    ("env", "expected"),
    full_unless(
        [
            OOM,
            ({"FAKE_NEURONX_CC_SIGNAL": str(int(signal.SIGABRT))}, "aborted (SIGABRT)"),
            ({"FAKE_NEURONX_CC_SIGNAL": str(int(signal.SIGSEGV))}, "crashed (SIGSEGV)"),
            ({"FAKE_NEURONX_CC_EXIT": "70"}, "exit status 70"),
        ],
        [OOM],
    ),
)
def test_compiler_failures_are_explained(lowered, tmp_path: Path, env, expected) -> None:
    out = tmp_path / "failed"
    proc = _compile(lowered("llama"), out, **env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert expected in proc.stderr and "neuronx-cc.log" in proc.stderr
    assert not out.exists()  # nothing half-written


def test_build_with_compiler_compiles_and_caches(
    lowered, hf_model_dir, tmp_path: Path, monkeypatch
) -> None:
    """`neffkit build` on a host with neuronx-cc: NEFFs in one step; a rebuild hits the cache.
    The first build lowers afresh (an empty cache): its HLO protos are byte-identical to those
    of the lowered llama bundle, lowered separately (the same graphs: the KV cache sized
    alike, its largest context alone)."""
    monkeypatch.setenv("NEFFKIT_NEURONX_CC", str(STAND_IN))
    buckets = {**LOWERED[("llama", 1)], "context": [64]}
    model = hf_model_dir("llama")
    path = write_manifest(tmp_path / "withcc.yaml", model, **NEURON, buckets=buckets)
    cache = tmp_path / "cache"
    build = ("build", str(path), "-o", str(tmp_path / "b"), "--cache", str(cache), "-j", "1")
    first = json.loads(run_cli(*build, "--json", check=True).stdout)
    again = json.loads(run_cli(*build, "--json", check=True).stdout)
    assert first["counters"]["compiled"] == 2 and first["counters"]["cache_hits"] == 0
    assert again["counters"]["compiled"] == 0 and again["counters"]["cache_hits"] == 2
    graphs = bundle_json(tmp_path / "b")["graphs"]
    assert all(g["compiler"]["argv"][0] == "neuronx-cc" for g in graphs)
    assert [g["name"] for g in graphs] == ["prefill_t16_c64", "decode_b2_c64"]
    reference = lowered("llama", 1)
    for g in graphs:
        assert (reference / g["hlo"]).read_bytes() == (tmp_path / "b" / g["hlo"]).read_bytes()


# ---------------------------------------------------------------- NEFF header


def test_neff_header_round_trip_and_checks() -> None:
    data = b"x" * 100
    raw = (
        pack_header(
            data_size=len(data),
            name="decode_b1_c64",
            lnc_size=2,
            neff_version=(2, 3),
            feature_bits=0b101,
            digest=bytes(range(32)),
        )
        + data
    )
    assert len(raw) == HEADER_SIZE + 100
    h = parse_header(raw, len(raw))
    assert (h.name, h.lnc_size, h.neff_version, h.feature_bits) == ("decode_b1_c64", 2, "2.3", 5)
    assert h.hash == bytes(range(32)).hex()
    with pytest.raises(NeffError, match="truncated"):
        parse_header(raw, len(raw) - 1)
    with pytest.raises(NeffError, match="shorter"):
        parse_header(raw[:100])
    assert compatibility_problems(h, h.to_json(), lnc=2) == []
    assert compatibility_problems(h, h.to_json(), lnc=1) == [
        "compiled for lnc=2, the runtime uses lnc=1"
    ]
    other = {**h.to_json(), "neff_version_minor": 4}
    assert compatibility_problems(h, other) == ["neff_version_minor is 3, the bundle recorded 4"]


# ---------------------------------------------------------------- the neuron executor vs spike


SPIKE_STAND_IN = REPO / "tests" / "tools"  # holds `spike/`, the stand-in for nkipy's bindings


def test_neuron_executor_runs_a_compiled_bundle_through_spike(
    lowered, hf_model_dir, hf_greedy, tmp_path: Path
) -> None:
    """`run --executor neuron` on stand-in NEFFs, through a `spike` with nkipy's signatures that
    executes the NEFF's HLO on XLA:CPU: HF's tokens over 12 steps (so every aliased K/V output
    landed in the resident cache tensors), weights and caches uploaded once at load, each step
    writing only metadata and reading back only the sampled tokens and logprobs."""
    out = tmp_path / "compiled"
    assert _compile(lowered("llama"), out).returncode == 0
    log = tmp_path / "spike.jsonl"
    prompts = [[5, 17, 300, 42, 7], list(range(3, 23))]
    args = [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neffkit",
            "run",
            str(out),
            "--executor",
            "neuron",
            *args,
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": f"{SPIKE_STAND_IN}{os.pathsep}{REPO}",
            "SPIKE_STAND_IN_LOG": str(log),
        },
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outputs = json.loads(proc.stdout)["outputs"]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got["token_ids"] == hf_greedy(hf_model_dir("llama"), prompt, 12)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    first_run = next(i for i, c in enumerate(calls) if c["call"] == "execute")
    assert all(c["call"] != "from_numpy" for c in calls[first_run:])  # nothing allocated later
    record = read_bundle(out).record
    resident = [c["name"] for c in calls if c["call"] == "from_numpy"]
    lay = record.layout
    statics = lay.kv_names + lay.state_names + list(record.weights_of(0).names)
    assert all(resident.count(name) == 1 for name in statics)  # uploaded once, shared by graphs
    # decode takes no input_ids (its tokens come from the resident last_tokens), and a decode
    # step after one of the same graph whose rows kept their sequences sends only what moved:
    # positions, slots and lengths (block tables, sampling values and seq_slots stay)
    inputs = {g.name: [i.name for i in g.inputs] for g in record.graphs}
    previous, written, steady = None, set(), 0
    for c in calls[first_run:]:
        if c["call"] == "write_from_numpy":
            written.add(int(c["name"].removeprefix("input")))
        elif c["call"] == "execute":
            names = {inputs[c["name"]][i] for i in written}
            if c["name"].startswith("decode_"):
                assert "input_ids" not in inputs[c["name"]]
                steady += c["name"] == previous and names == {
                    "positions",
                    "slot_mapping",
                    "context_lens",
                }
            previous, written = c["name"], set()
    assert steady >= 5
    runs = sum(c["call"] == "execute" for c in calls)
    reads = [c for c in calls if c["call"] == "numpy"]
    assert len(reads) == 4 * runs  # tokens, token logprobs, top ids, top logprobs: nothing else
    loads = [c for c in calls if c["call"] == "load_from_neff"]
    assert len(loads) == len(record.graphs)
    assert all((c["rank_id"], c["world_size"], c["cc_enabled"]) == (0, 1, False) for c in loads)


def test_neuron_executor_gives_each_rank_its_rank_and_world_size(
    lowered, tmp_path: Path, monkeypatch
) -> None:
    """A tp=2 bundle's rank 1 loads its NEFFs with rank_id 1, world_size 2 and collectives
    enabled, and uploads its own shard (the stand-in cannot run collectives: loading only)."""
    out = tmp_path / "compiled"
    assert _compile(lowered("llama", 2), out).returncode == 0
    monkeypatch.syspath_prepend(str(SPIKE_STAND_IN))
    import spike

    from neffkit.runtime.engine.loading import load

    spike.CALLS.clear()
    load(out, rank=1, world_size=2, executor="neuron")
    loads = [c for c in spike.CALLS if c["call"] == "load_from_neff"]
    assert loads and all(
        (c["rank_id"], c["world_size"], c["cc_enabled"]) == (1, 2, True) for c in loads
    )


def test_neff_tensors_are_matched_by_position_or_refused() -> None:
    from neffkit.errors import BundleError
    from neffkit.runtime.worker.executors import by_position

    names = {"input2": 0, "input0": 0, "input1": 0}
    assert by_position(names, "input", 3, Path("g.neff")) == ["input0", "input1", "input2"]
    with pytest.raises(BundleError, match=r"do not number 0\.\.2"):
        by_position({"input0": 0, "input1": 0, "kv": 0}, "input", 3, Path("g.neff"))


# ---------------------------------------------------------------- a bundle as one file


def _run_ids(bundle: Path, env: dict[str, str]) -> list[list[int]]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neffkit",
            "run",
            str(bundle),
            "--executor",
            "xla-cpu",
            "--prompt-ids",
            "5,17,300,42,7",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]]


def test_build_pack_round_trips_through_run_and_inspect(lowered, session_dir, tmp_path):
    """`build --pack` writes BUNDLE.tar.zst beside the bundle; `run` and `inspect --verify` on
    the pack equal the directory's (extracted once into the bundle cache, keyed by digest).
    The lowered llama bundle's manifest: its graphs come from the cache."""
    cache = tmp_path / "bundles"
    env = {"NEFFKIT_BUNDLES": str(cache)}
    lowered("llama", 1)
    path = session_dir / "llama_neuron_tp1.yaml"
    out = tmp_path / "packed"
    proc = run_cli(
        "build",
        str(path),
        "-o",
        str(out),
        "--lower-only",
        "--pack",
        "-j",
        "1",
        "--cache",
        str(artifact_cache()),
        "--json",
        check=True,
    )
    pack = Path(json.loads(proc.stdout)["pack"])
    assert pack == tmp_path / "packed.tar.zst" and pack.is_file()
    assert _run_ids(pack, env) == _run_ids(out, env)
    inspect = [sys.executable, "-m", "neffkit", "inspect", "--verify", "--json"]
    got = json.loads(
        subprocess.run(
            [*inspect, str(pack)],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            check=True,
        ).stdout
    )
    want = json.loads(run_cli("inspect", str(out), "--verify", "--json", check=True).stdout)
    assert got["digest"] == want["digest"] and got["graphs"] == want["graphs"]
    assert [p.name for p in cache.iterdir()] == [want["digest"]]  # extracted once, by digest


def test_truncated_or_altered_packs_are_refused(lowered, tmp_path, monkeypatch):
    import tarfile

    import zstandard

    from neffkit.contract.pack import pack_bundle
    from neffkit.contract.read import read_bundle
    from neffkit.errors import BundleError

    cache = tmp_path / "bundles"
    monkeypatch.setenv("NEFFKIT_BUNDLES", str(cache))
    src = tmp_path / "src"
    shutil.copytree(lowered("llama"), src)
    pack = pack_bundle(src)
    truncated = tmp_path / "truncated.tar.zst"
    truncated.write_bytes(pack.read_bytes()[: pack.stat().st_size // 2])
    with pytest.raises(BundleError, match="truncated or damaged pack"):
        read_bundle(truncated)
    # the same bundle.json, one weight byte changed: the hash check names the file
    weights = src / "weights" / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    altered = tmp_path / "altered.tar.zst"
    with altered.open("wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as zw:
        with tarfile.open(fileobj=zw, mode="w|") as tar:
            tar.add(src / "bundle.json", "bundle.json")
            for rel in sorted(read_bundle(src, verify=False).record.files):
                tar.add(src / rel, rel)
    with pytest.raises(BundleError, match=r"altered\.tar\.zst: .*weights/rank0\.safetensors"):
        read_bundle(altered)
    assert [p for p in cache.iterdir()] == []  # nothing half-extracted is kept
