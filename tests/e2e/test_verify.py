"""`build --verify` on the cpu target: AOTInductor packages against the eager model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from neffkit.compile.layout import target_layout
from neffkit.compile.plan import make_plan
from neffkit.compile.verify import run as verify
from neffkit.manifest import load_manifest
from neffkit.platform import cpu_kernels
from tests.support.cache import artifact_cache
from tests.support.cli import bundle_json, run_cli


def _setup(bundle_dir: Path, session_dir: Path):
    manifest = load_manifest(session_dir / "llama.yaml")  # written by the session bundle fixture
    layout = target_layout(manifest)
    tensors = load_file(str(bundle_dir / "weights" / "rank0.safetensors"))
    return manifest, layout, [tensors[w.name] for w in layout.weights]


def test_verify_passes_for_built_artifacts_and_catches_a_wrong_one(bundle, session_dir) -> None:
    bundle_dir = bundle("llama")
    manifest, layout, weights = _setup(bundle_dir, session_dir)
    data = bundle_json(bundle_dir)
    cpu_kernels.ensure_for_tracing()  # the graphs call its ops (a build has loaded it to trace)
    for spec in make_plan(manifest).graphs:
        entry = next(g for g in data["graphs"] if g["name"] == spec.name)
        names = [i["name"] for i in entry["inputs"]]
        runner = verify.aoti_runner(bundle_dir / entry["artifact"], names)
        result = verify.verify_graph(layout, spec, weights, runner, "aotinductor")
        assert result.ok and result.tokens_equal and result.max_kv_error < 1e-4, spec.name

        def broken(inputs: list[torch.Tensor], runner=runner, names=names) -> tuple:
            # the same artifact fed a damaged layer-0 q_proj: the check must notice
            damaged = list(inputs)
            i = names.index("model.layers.0.self_attn.q_proj.weight")
            damaged[i] = damaged[i] * 3.0
            return runner(damaged)

        bad = verify.verify_graph(layout, spec, weights, broken, "aotinductor")
        assert not bad.ok, spec.name


def test_build_verify_records_results(bundle, session_dir, tmp_path: Path) -> None:
    bundle("llama")  # fills the session cache: this rebuild compiles nothing
    out = tmp_path / "verified"
    run_cli(
        "build",
        str(session_dir / "llama.yaml"),
        "-o",
        str(out),
        "--cache",
        str(artifact_cache()),
        "--verify",
        check=True,
    )
    for g in bundle_json(out)["graphs"]:
        assert g["verify"]["ok"] and g["verify"]["executor"] == "aotinductor", g["name"]
