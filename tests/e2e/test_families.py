"""Every family's model code against HF transformers, with nothing compiled: the graphs a build
would trace, run eagerly (tests/eager.py) on each family's random checkpoint. Greedy tokens of
a packed prefill and the decode steps after it equal HF's. The compiled bundles' own parity
(tests/e2e/test_generate.py) adds what Inductor and the runtime do to the same graphs."""

from __future__ import annotations

import pytest
import torch

from neffkit.compile.layout import model_layout
from neffkit.manifest import load_manifest
from neffkit.models.weights import load_weights
from tests.eager import eager_greedy
from tests.support.models import LONG, MAX_NEW, MIXED, MODELS, SHORT, write_manifest


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


@pytest.mark.parametrize("kind", [k for k in MODELS if not k.startswith("deepseek")])
def test_rotated_keys_put_their_offsets_back_exactly(kind, hf_model_dir, hf_greedy, tmp_path):
    """An fp8 cache's rotated keys (kv_cache.rotate_keys) are stored less an offset that
    depends on their position and read back with it, through each family's own positional
    encoding (Gemma 3's local RoPE, Llama 4's NoPE layers and L2 norms, Cohere's interleaved
    pairs, GPT-OSS's sinks, Gemma 2's soft cap). With the forms a calibration measures but a
    float32 cache and scales of 1, nothing is rounded: a packed prefill and the decode steps
    after it give HF's greedy tokens, so the offsets (moved far from the keys here, so a
    misplaced one would show) go back exactly where they came from.
    (MLA's latent cache rotates nothing.)"""
    import dataclasses

    from neffkit.compile.calibrate import kv_calibration

    model_dir = hf_model_dir(kind)
    kv = {"block_size": 16, "dtype": "float8_e4m3fn"}
    path = write_manifest(tmp_path / "m.yaml", model_dir, buckets=MODELS[kind][2], kv_cache=kv)
    manifest = load_manifest(path)
    layout = model_layout(manifest, "cpu")  # the fp8 layout: its graphs take the key forms
    measured = kv_calibration(manifest, layout.storage)
    layers = manifest.model_config.num_layers
    assert all(len(measured[f]) == layers for f in ("k_offsets", "k_firsts", "k_smooth"))
    measured["kv_calibrated"] = ((1.0, 1.0),) * layers
    gen = torch.Generator().manual_seed(0)
    for field in ("k_offsets", "k_firsts"):  # far from the keys: a misplaced one shows
        measured[field] = tuple(
            tuple((torch.tensor(v) + 4 * torch.randn(len(v), generator=gen)).tolist())
            for v in measured[field]
        )
    storage = dataclasses.replace(layout.storage, **measured)
    layout = dataclasses.replace(layout, storage=storage, kv_dtype="float32")
    weights = load_weights(manifest.model, manifest.model_config, storage)
    assert "kv.k_rotation" in weights and "kv.k_rotation" in {w.name for w in layout.weights}
    for prompts in ([LONG], MIXED):
        got = eager_greedy(layout, weights, prompts, MAX_NEW)
        assert got == [hf_greedy(model_dir, p, MAX_NEW) for p in prompts], kind
