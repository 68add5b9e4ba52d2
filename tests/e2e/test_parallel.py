"""Tensor and expert parallelism: tp=2 (and ep=2) bundles against HF, SPMD, multi-rank runtime."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from neffkit.compile.spmd import SPMDMismatchError
from tests.support import REPO
from tests.support.bundles import TP2_IN_TEST
from tests.support.cli import run_ids as _run
from tests.support.models import LONG, MAX_NEW, MIXED, PARALLEL, SHORT, write_manifest


# tp=2 of llama in `make test` (TP2_IN_TEST); every other family's in `make test-all`
@pytest.mark.parametrize(
    "kind",
    [k if k in TP2_IN_TEST else pytest.param(k, marks=pytest.mark.full) for k in PARALLEL],
)
def test_parallel_bundle_matches_hf(kind, tp_bundle, hf_model_dir, hf_greedy):
    result = tp_bundle(kind)
    graphs = result.counters["graphs"]
    # every rank traced, one compile per graph: the SPMD check proved one artifact serves all
    assert result.counters["traced"] + result.counters["trace_hits"] == 2 * graphs
    assert result.counters["compiled"] + result.counters["cache_hits"] == graphs
    assert result.counters["spmd_groups"] == graphs
    assert all(
        g["ranks"] == "all"
        for g in json.loads((result.bundle / "bundle.json").read_text())["graphs"]
    )
    model = hf_model_dir(kind)
    prompts = [SHORT, LONG, *MIXED]
    assert _run(result.bundle, prompts) == [hf_greedy(model, p, MAX_NEW) for p in prompts]


@pytest.mark.full  # both bundles are compared with HF on a superset of these prompts
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_parallel_bundle_matches_its_tp1_bundle(kind, tp_bundle, bundle):
    prompts = [SHORT, *MIXED]
    assert _run(tp_bundle(kind).bundle, prompts) == _run(bundle(kind), prompts)


def test_moe_layouts(lowered):
    """bundle.json of an ep=2 bundle (the lowered one: its layout is every target's)."""
    data = json.loads((lowered("mixtral", 2) / "bundle.json").read_text())
    assert data["layout"]["rank_input"] is True  # ep=2: experts picked by a rank tensor
    names = data["weights"][1]["names"]
    assert "model.layers.0.moe.gate_up" in names
    inputs = [i["name"] for i in data["graphs"][0]["inputs"]]
    assert inputs[inputs.index("rank") + 1] == "k_cache.0"


def test_200_decode_steps_at_tp2(tp_bundle, hf_model_dir, hf_greedy):
    out = _run(tp_bundle("llama").bundle, [SHORT], 200, "--ignore-eos")
    assert len(out[0]) == 200
    assert out[0] == hf_greedy(hf_model_dir("llama"), SHORT, 200)


@pytest.fixture()
def no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_rank_leaking_into_a_slice_fails_spmd(
    monkeypatch, hf_model_dir, tmp_path, no_process_group
):
    """A Python-int rank in a slice makes rank graphs differ; the build names diff and line."""
    from neffkit.compile.build import build
    from neffkit.manifest import load_manifest
    from neffkit.models.decoder import DecoderGraph

    original = DecoderGraph.reduce

    def leaky(self, partial, bias):
        r = dist.get_rank()
        kept = partial[..., r:]  # the bug: a Python int from the rank reaches a slice
        pad = partial.new_zeros(partial.shape[:-1] + (r,))
        return original(self, torch.cat([kept, pad], dim=-1), bias)

    monkeypatch.setattr(DecoderGraph, "reduce", leaky)
    manifest = write_manifest(
        tmp_path / "leak.yaml",
        hf_model_dir("llama_tied"),
        parallel={"tp": 2},
        buckets={"prefill": [16], "decode": [1], "context": [32]},
    )
    with pytest.raises(SPMDMismatchError) as err:
        build(load_manifest(manifest), tmp_path / "out", jobs=1)
    message = str(err.value)
    assert "ranks 0 and 1 traced different graphs" in message
    assert "--- rank0/prefill_t16_c32" in message and "+++ rank1/prefill_t16_c32" in message
    # the innermost model line the differing node came from: the leaking slice itself
    assert "test_parallel.py" in message and "kept = partial[..., r:]" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.full  # four fresh compiles every run: `make test-all`
def test_per_rank_artifacts_opt_in(
    monkeypatch, hf_model_dir, hf_greedy, tmp_path, no_process_group
):
    """With parallel.per_rank_artifacts, a rank-dependent graph compiles once per rank, the
    bundle says so, and each rank loads its own artifact."""
    from neffkit.compile.build import build
    from neffkit.manifest import load_manifest
    from neffkit.models.decoder import DecoderGraph

    original = DecoderGraph.reduce

    def rank_leak(self, partial, bias):
        # rank-dependent constants that cancel exactly: x * 2.0 / 2 == x in binary floating point
        scale = 1 + dist.get_rank()
        return original(self, partial * float(scale) / scale, bias)

    monkeypatch.setattr(DecoderGraph, "reduce", rank_leak)
    manifest = write_manifest(
        tmp_path / "pr.yaml",
        hf_model_dir("llama_tied"),
        parallel={"tp": 2, "per_rank_artifacts": True},
        buckets={"prefill": [16], "decode": [1], "context": [32]},
    )
    result = build(load_manifest(manifest), tmp_path / "out", jobs=1)
    assert result.counters["per_rank_graphs"] == 2 and result.counters["compiled"] == 4
    data = json.loads((tmp_path / "out" / "bundle.json").read_text())
    assert [(g["name"], g["ranks"]) for g in data["graphs"]] == [
        ("prefill_t16_c32", [0]),
        ("prefill_t16_c32", [1]),
        ("decode_b1_c32", [0]),
        ("decode_b1_c32", [1]),
    ]
    assert data["graphs"][1]["artifact"] == "graphs/prefill_t16_c32.rank1.pt2"
    assert _run(tmp_path / "out", [SHORT], 6) == [hf_greedy(hf_model_dir("llama_tied"), SHORT, 6)]


def test_a_dead_rank_fails_the_others_fast(tp_bundle):
    """torchrun-style launch; rank 1 joins then dies: rank 0 errors out instead of hanging."""
    bundle = tp_bundle("llama").bundle
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29651", "WORLD_SIZE": "2"}
    die = (
        "from neffkit.runtime.worker.distributed import _init; import os; "
        "_init('gloo', 10); os._exit(1)"
    )
    rank1 = subprocess.Popen([sys.executable, "-c", die], env={**env, "RANK": "1"}, cwd=REPO)
    t0 = time.time()
    rank0 = subprocess.run(
        [
            sys.executable,
            "-m",
            "neffkit",
            "run",
            str(bundle),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "40",
            "--dist-timeout",
            "10",
        ],
        env={**env, "RANK": "0"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rank1.wait(timeout=30)
    assert rank0.returncode == 2, rank0.stderr
    assert "lost contact with the other ranks" in rank0.stderr
    assert "Traceback" not in rank0.stderr
    assert time.time() - t0 < 60
