"""Every family's model code against HF transformers, with nothing compiled: the graphs a build
would trace, run eagerly (tests/eager.py) on each family's random checkpoint. Greedy tokens of
a packed prefill and the decode steps after it equal HF's. The compiled bundles' own parity
(tests/e2e/test_generate.py) adds what Inductor and the runtime do to the same graphs."""

from __future__ import annotations

import pytest

from neffkit.compile.layout import model_layout
from neffkit.manifest import load_manifest
from neffkit.models.weights import load_weights
from tests.conftest import LONG, MAX_NEW, MIXED, MODELS, SHORT, write_manifest
from tests.eager import eager_greedy


@pytest.mark.parametrize("kind", list(MODELS))
def test_eager_graphs_match_hf_greedy(kind, hf_model_dir, hf_greedy, tmp_path):
    model_dir = hf_model_dir(kind)
    path = write_manifest(tmp_path / "m.yaml", model_dir, buckets=MODELS[kind][2])
    manifest = load_manifest(path)
    layout = model_layout(manifest, "cpu")
    weights = load_weights(manifest.model, manifest.model_config, layout.storage)
    for prompts in ([SHORT], [LONG], MIXED):
        got = eager_greedy(layout, weights, prompts, MAX_NEW)
        want = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
        assert got == want, (kind, [len(p) for p in prompts])
