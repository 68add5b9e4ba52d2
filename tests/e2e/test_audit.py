"""Every audit rule with a small graph or manifest that triggers it and one that does not."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest

from neffkit.contract.bundle import read_zst_text, write_zst_text
from tests.support import REPO
from tests.support.cli import run_cli


def test_model_graphs_are_clean(bundle, tp_bundle):
    """neffkit's own graphs (tp=1 and tp=2) pass every rule."""
    for path in (bundle("llama"), tp_bundle("llama").bundle):
        report = json.loads(run_cli("inspect", str(path), "--json", check=True).stdout)
        assert report["findings"] == [] and report["finding_counts"]["error"] == 0


def test_build_fails_on_audit_error_unless_waived(monkeypatch, hf_model_dir, tmp_path):
    from neffkit.compile.build import build
    from neffkit.errors import BuildError
    from neffkit.kernels import kv
    from neffkit.manifest import load_manifest
    from tests.support.models import write_manifest

    def unclamped(k_cache, v_cache, k, v, slot_mapping):
        block_size = k_cache.shape[1]
        k_cache.index_put_((slot_mapping // block_size, slot_mapping % block_size), k)
        v_cache.index_put_((slot_mapping // block_size, slot_mapping % block_size), v)

    from neffkit.models import decoder  # imported first: it binds kv.write_kv when imported

    monkeypatch.setattr(kv, "write_kv", unclamped)
    monkeypatch.setattr(decoder, "write_kv", unclamped)
    buckets = {"prefill": [16], "decode": [1], "context": [32]}
    path = write_manifest(tmp_path / "m.yaml", hf_model_dir("llama_tied"), buckets=buckets)
    with pytest.raises(BuildError, match=r"audit error\(s\); first: NK101") as err:
        build(load_manifest(path), tmp_path / "out", jobs=1)
    assert "waive it with `audit: {waive: [NK101]}`" in str(err.value)
    assert not (tmp_path / "out").exists()
    waived = write_manifest(
        tmp_path / "w.yaml", hf_model_dir("llama_tied"), buckets=buckets, audit={"waive": ["NK101"]}
    )
    result = build(load_manifest(waived), tmp_path / "out", jobs=1, dry_run=True)
    assert {f.rule for f in result.findings} == {"NK101"}
    assert all(f.waived for f in result.findings)


def test_inspect_json_schema_and_ci_gate(bundle, tmp_path):
    schema = json.loads((REPO / "docs" / "inspect.schema.json").read_text())
    copy = tmp_path / "b"
    shutil.copytree(bundle("llama_tied"), copy)
    report = json.loads(run_cli("inspect", str(copy), "--json", "--verify", check=True).stdout)
    jsonschema.validate(report, schema)
    assert report["verified"] is True
    # ship a graph with a hazard in it: inspect reports it and exits 1 so CI can gate
    ir = copy / "ir" / "decode_b1_c64.txt.zst"
    text = read_zst_text(ir)
    # the clamp of the KV slots (slot_mapping, flattened, then clamped for every layer's writes)
    slots = re.search(r"^(%\d+) = input slot_mapping ", text, re.M).group(1)
    flat = re.search(rf"^(%\d+) = aten\.view\.default\({slots},", text, re.M).group(1)
    clamp = re.search(rf"aten\.clamp\.default\({flat},", text)
    text = text[: clamp.start()] + text[clamp.start() :].replace("aten.clamp", "aten.abs", 1)
    write_zst_text(ir, text)
    proc = run_cli("inspect", str(copy), "--json")
    assert proc.returncode == 1
    bad = json.loads(proc.stdout)
    jsonschema.validate(bad, schema)
    # layer 0's K and V writes both lost their clamp
    assert [f["rule"] for f in bad["findings"]] == ["NK101", "NK101"]
    assert {f["graph"] for f in bad["findings"]} == {"decode_b1_c64"}
    detail = json.loads(run_cli("inspect", str(copy), "--graph", "decode_b1_c64", "--json").stdout)
    # K and V of 2 layers, and (decode_state: device) the sampled token into last_tokens
    assert detail["op_histogram"]["aten.index_put.default"] == 5
    assert [f["rule"] for f in detail["findings"]] == ["NK101", "NK101"]
    # --verify notices the edited file
    verified = run_cli("inspect", str(copy), "--verify")
    assert verified.returncode == 2 and "ir/decode_b1_c64.txt.zst is corrupt" in verified.stderr


def test_inspect_verify_says_what_it_verified(bundle, tmp_path):
    """`--verify` prints the files, bytes and hash it checked and the result, not silence."""
    path = bundle("llama_tied")
    files = json.loads((path / "bundle.json").read_text())["files"]
    size = sum((path / rel).stat().st_size for rel in files)
    proc = run_cli("inspect", str(path), "--verify", check=True)
    line = proc.stdout.strip().splitlines()[-1]
    assert line == (
        f"verified {path}: {len(files)} files, {size:,} bytes, every sha256 equal to "
        "bundle.json's: ok"
    ), proc.stdout
    report = json.loads(run_cli("inspect", str(path), "--verify", "--json", check=True).stdout)
    assert report["verification"] == [
        {"bundle": str(path), "files": len(files), "bytes": size, "hash": "sha256", "result": "ok"}
    ]
