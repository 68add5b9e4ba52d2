"""Bundle format: contents, io-alias map, and refusal of damaged or mismatched bundles."""

from __future__ import annotations

import json
import shutil

import pytest

from neffkit.compile.flags import BASE_NEURON_FLAGS
from neffkit.contract.bundle import read_zst_text
from neffkit.contract.read import read_bundle
from tests.support.cli import bundle_json, run_cli
from tests.unit.refusals import refused as _refused


@pytest.fixture()
def bundle_copy(bundle, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(bundle("llama_tied"), dst)
    return dst


def test_bundle_layout_and_alias_map(bundle):
    b = read_bundle(bundle("llama"))
    data = b.record.to_json()
    assert data["format"] == 1 and data["target"] == "cpu"
    names = [g["name"] for g in data["graphs"]]
    assert names == ["prefill_t16_c64", "prefill_b4_t16_c64", "decode_b1_c64", "decode_b4_c64"]
    for g in data["graphs"]:
        aliased = sorted(a["input"] for a in g["io_alias"])
        assert aliased == sorted(f"{kv}_cache.{i}" for kv in "kv" for i in range(2))
        input_names = [i["name"] for i in g["inputs"]]
        assert input_names[:5] == [
            "input_ids",
            "positions",
            "slot_mapping",
            "block_tables",
            "context_lens",
        ]
        assert g["ranks"] == "all"
        text = read_zst_text(b.path(g["ir"]))
        assert "aten.index_put" in text and "File" not in text
    assert set(data["files"]) >= {"weights/rank0.safetensors", "tokenizer/tokenizer.json"}
    assert data["weights"][0]["names"][0] == "model.embed_tokens.weight"
    assert "lm_head.weight" in data["weights"][0]["names"]


def test_tied_bundle_has_no_lm_head(bundle):
    names = bundle_json(bundle("llama_tied"))["weights"][0]["names"]
    assert "lm_head.weight" not in names


def test_flipped_byte_is_refused(bundle_copy):
    target = bundle_copy / "weights" / "rank0.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    _refused(bundle_copy, "weights/rank0.safetensors is corrupt")


def test_missing_file_is_refused(bundle_copy):
    (bundle_copy / "graphs" / "decode_b1_c64.pt2").unlink()
    _refused(bundle_copy, "graphs/decode_b1_c64.pt2 is missing")


def test_future_format_is_refused(bundle_copy):
    meta = bundle_copy / "bundle.json"
    data = json.loads(meta.read_text())
    data["format"] = 2
    meta.write_text(json.dumps(data))
    _refused(bundle_copy, "bundle format 2 is not supported", "hint:")


def test_other_torch_version_is_refused(bundle_copy):
    meta = bundle_copy / "bundle.json"
    data = json.loads(meta.read_text())
    data["versions"]["torch"] = "2.99.0"
    meta.write_text(json.dumps(data))
    _refused(bundle_copy, "built with torch 2.99.0", "install torch==2.99.0")


def test_missing_cpu_feature_is_refused(bundle_copy):
    meta = bundle_copy / "bundle.json"
    data = json.loads(meta.read_text())
    data["host"]["cpu_flags"].append("amx_int8")
    data["host"]["cpu_flags"].append("sve")  # no x86 CPU has both
    meta.write_text(json.dumps(data))
    _refused(bundle_copy, "which this CPU lacks")


def test_inspect_lists_graphs(bundle):
    proc = run_cli("inspect", str(bundle("llama_tied")), "--json", check=True)
    summary = json.loads(proc.stdout)
    assert [g["name"] for g in summary["graphs"]] == [
        "prefill_t16_c64",
        "decode_b1_c64",
        "decode_b4_c64",
    ]
    # K and V of 2 layers, and llama_tied's decode state (decode_state: device)
    assert all(len(g["io_alias"]) == 5 for g in summary["graphs"])
    text = run_cli("inspect", str(bundle("llama_tied")), check=True).stdout
    assert "decode_b4_c64" in text and "tp=1" in text and "prefix caching on" in text
    assert summary["layout"]["prefix_caching"] is True


def test_load_hashes_what_the_rank_reads(bundle_copy):
    """Loading verifies the files a rank reads (graphs, its shard, tokenizer); a file it never
    reads (the canonical graph text in ir/) is `inspect --verify`'s to check."""
    ir = bundle_copy / "ir" / "decode_b1_c64.txt.zst"
    ir.write_bytes(ir.read_bytes() + b"\0")
    ok = run_cli("run", str(bundle_copy), "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert ok.returncode == 0, ok.stderr
    checked = run_cli("inspect", str(bundle_copy), "--verify")
    assert checked.returncode == 2 and "ir/decode_b1_c64.txt.zst is corrupt" in checked.stderr


def test_cpu_targets_get_no_neuron_base_flags(bundle):
    for g in bundle_json(bundle("llama_tied"))["graphs"]:
        assert g["flags"] == [] and not set(g["flags"]) & set(BASE_NEURON_FLAGS)
