"""cpu_kernel auto times neffkit's kernel against Inductor's form on this host, per graph row
count (decode rows, prefill tokens), takes the faster, and keeps the measurement so a rebuild
here chooses the same."""

from __future__ import annotations

import dataclasses
import json

import pytest

from neffkit.compile.autotune import THIN, autotuned, margin_of
from neffkit.compile.layout import (
    blocked_weight_bytes,
    projection_form,
    target_layout,
    uses_kernel,
)
from neffkit.compile.units import NOISE
from neffkit.contract.records import GraphRecord
from neffkit.manifest import load_manifest
from neffkit.platform import cpu_kernels
from tests.support.models import write_manifest

pytestmark = pytest.mark.skipif(not cpu_kernels.supported(), reason="needs AVX-512")


@pytest.mark.full  # compiles and times both forms on every run: `make test-all`
def test_auto_takes_the_form_that_measured_faster_and_keeps_the_measurement(
    tmp_path, monkeypatch, hf_model_dir
):
    monkeypatch.setenv("NEFFKIT_KERNEL_CACHE", str(tmp_path / "kernels"))
    manifest = load_manifest(write_manifest(tmp_path / "m.yaml", hf_model_dir("llama")))
    layout = target_layout(manifest)
    assert layout.projection.kernel == "auto"
    # only the largest blocked weights count as large, so the three forms differ
    threshold = max(blocked_weight_bytes(layout))
    assert min(blocked_weight_bytes(layout)) < threshold
    small = dataclasses.replace(layout.projection, kernel_min_bytes=threshold)
    layout = dataclasses.replace(layout, projection=small)
    # five row counts (16 and 200: a prefill's tokens, 200 timed at 128 and scaled): fifteen
    # compiles of one function, past Dynamo's per-function limit of 8
    tuned, timings = autotuned(layout, [1, 3, 2, 16, 200, 3])
    assert [t.rows for t in timings] == [1, 2, 3, 16, 200]
    assert all(min(t.kernel_ms, t.inductor_ms, t.kernel_all_ms) > 0 for t in timings)
    for t in timings:  # the graphs write what measured fastest (beyond noise), and the figures
        fastest = min(t.kernel_ms, t.inductor_ms, t.kernel_all_ms)
        assert t.margin == pytest.approx(margin_of(t.forms), abs=1e-4)
        assert t.forms[t.chosen] == fastest if t.margin >= NOISE else t.chosen == "kernel"
        inductor = "blocked-rows" if t.rows <= 8 else "blocked-bmm"
        forms = {
            "kernel": f"kernel-rows+{inductor}",
            "kernel-all": "kernel-rows",
            "inductor": inductor,
        }
        assert projection_form(tuned, t.rows) == forms[t.chosen]
    assert projection_form(tuned, 32) == "blocked-bmm"  # a row count not measured
    assert uses_kernel(tuned) == any(t.chosen != "inductor" for t in timings)
    # kept per host and shape: a clear choice is not measured again (its file untouched), a
    # thin one is, once more, its figures pooled
    kept = sorted((tmp_path / "kernels" / "autotune").glob("*.json"))
    assert len(kept) == 5
    stamps = {p: p.stat().st_mtime_ns for p in kept}
    _, timings_again = autotuned(layout, [200, 16, 3, 2, 1])
    for first, again in zip(timings, timings_again, strict=True):
        assert again == first if first.margin >= THIN else again.measurements == 2
    for p in kept:
        entry = json.loads(p.read_text())
        assert (p.stat().st_mtime_ns == stamps[p]) == (entry["measurements"] == 1)
    assert {json.loads(p.read_text())["rows"] for p in kept} == {1, 2, 3, 16, 200}


def test_prefill_row_counts_time_the_layers_without_the_lm_head(hf_model_dir, tmp_path):
    """A prefill graph runs the LM head on each sequence's last token only, so its token count
    is timed on the layers' projections alone (the head's row count is timed on its own)."""
    from neffkit.compile.autotune import _run_at, _timed_weights

    manifest = load_manifest(write_manifest(tmp_path / "m.yaml", hf_model_dir("llama")))
    layout = target_layout(manifest)
    small = dataclasses.replace(layout.projection, kernel_min_bytes=1)
    weights = _timed_weights(dataclasses.replace(layout, projection=small))
    assert "lm_head.weight" in {w.name for w in weights}
    assert _run_at(weights, 8) == weights
    assert [w.name for w in _run_at(weights, 16)] == [
        w.name for w in weights if w.name != "lm_head.weight"
    ]


def test_graph_records_carry_the_measurement_and_omit_it_otherwise():
    from neffkit.contract.records import GraphBuckets, KernelTiming

    base = dict(
        name="decode_b1",
        phase="decode",
        buckets=GraphBuckets(1, 1, 64),
        artifact=None,
        ir="ir/x.txt.zst",
        graph_sha256="0",
        cache_key=None,
        options={},
        option_origins={},
        flags=(),
        flag_origins={},
        io_alias=(),
        inputs=(),
        outputs=(),
        ranks="all",
    )
    timed = GraphRecord(**base, kernel_timing=KernelTiming(1.5, 2.0, "kernel", 1.7))
    data = timed.to_json()
    assert data["kernel_timing"] == {
        "kernel_ms": 1.5,
        "inductor_ms": 2.0,
        "chosen": "kernel",
        "kernel_all_ms": 1.7,
    }
    assert GraphRecord.from_json(data) == timed
    assert "kernel_timing" not in GraphRecord(**base).to_json()
