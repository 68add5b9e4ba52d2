"""GGUF files given as `model:`: every kept block type decodes to gguf-py's values bit for bit,
the source reads what transformers' loader makes of each tensor (q/k rows reordered on the codes),
the metadata directory is made once per content and its content is in the build's keys, and
every type or fix-up neffkit cannot keep quantized is refused by name (no build, no HF model run:
the metadata directory is transformers reading the file's metadata).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from neffkit.checkpoints.gguf import convert_gguf, processor_for
from neffkit.checkpoints.gguf_blocks import BLOCK_TYPES, decode_blocks
from neffkit.checkpoints.gguf_dir import POINTER, QUANT_TYPES, gguf_model_dir, row_order
from neffkit.checkpoints.gguf_source import gguf_source
from neffkit.checkpoints.quantized import QuantTensor
from neffkit.errors import ManifestError, ModelError
from neffkit.manifest import parse_manifest
from neffkit.models.quantization import weight_format
from tests.support.gguf_files import random_blocks, write_tiny_llama
from tests.support.models import SMALL

gguf = pytest.importorskip("gguf")


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("from_floats", [True, False], ids=["quantized", "random-bytes"])
@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_each_type_decodes_to_gguf_py_values_bit_for_bit(kind, from_floats):
    rng = np.random.default_rng(QUANT_TYPES.index(kind))
    for shape in [(8, 512), (3, 4, 256)]:
        raw = random_blocks(rng, kind, shape, from_floats)
        expected = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind])
        tensor = decode_blocks(raw, kind, shape)
        tensor.check(kind)
        assert tensor.shape == shape and tensor.scheme == BLOCK_TYPES[kind].scheme
        assert np.array_equal(_bits(tensor.dequantized().numpy()), _bits(expected)), kind


def test_the_block_table_is_gguf_py_s():
    assert tuple(BLOCK_TYPES) == QUANT_TYPES
    for kind, block in BLOCK_TYPES.items():
        sizes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        assert (block.block, block.size) == sizes, kind
        assert block.block % block.scheme.group == 0, kind


def test_q8_0_keeps_both_ends_of_int8():
    """-128 (never written by llama.cpp, still a valid byte) and 127 as codes 0 and 255."""
    raw = random_blocks(np.random.default_rng(1), "Q8_0", (1, 32))
    raw[0, 2:4] = np.array([-128, 127], dtype=np.int8).view(np.uint8)
    tensor = decode_blocks(raw, "Q8_0", (1, 32))
    assert tensor.codes[0, :2].tolist() == [0, 255]
    expected = gguf.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(_bits(tensor.dequantized().numpy()), _bits(expected))


def test_a_short_tensor_is_refused():
    raw = random_blocks(np.random.default_rng(2), "Q4_K", (2, 256))
    with pytest.raises(ValueError, match="do not hold"):
        decode_blocks(raw, "Q4_K", (3, 256))


def test_llama_q_k_rows_are_reordered_as_transformers_reorders_them():
    config = {"num_attention_heads": 4, "num_key_value_heads": 2}
    processor = processor_for("llama", config)
    rows = np.arange(256 * 8, dtype=np.float32).reshape(256, 8)
    for name, shape in [("blk.0.attn_q.weight", (256, 8)), ("blk.0.attn_k.weight", (128, 8))]:
        order = row_order(processor, name, shape, {}, "Q4_K")
        assert order is not None and sorted(order.tolist()) == list(range(shape[0]))
        expected = processor.process(weights=rows[: shape[0]], name=name).weights
        assert np.array_equal(rows[: shape[0]][order], expected), name
    assert row_order(processor, "blk.0.attn_v.weight", (128, 8), {}, "Q4_K") is None


def test_a_fix_up_that_changes_values_is_refused_on_quantized_tensors_only():
    processor = processor_for("gemma3", {})  # Gemma's norms: weight - 1
    assert row_order(processor, "blk.0.attn_norm.weight", (64,), {}, "F32") is None
    with pytest.raises(ValueError, match="values changed"):
        row_order(processor, "blk.0.attn_norm.weight", (64, 32), {}, "Q8_0")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The GGUF cache in a directory of this module's own."""
    root = tmp_path_factory.mktemp("gguf-cache")
    old = os.environ.get("NEFFKIT_GGUF_CACHE")
    os.environ["NEFFKIT_GGUF_CACHE"] = str(root)
    yield root
    if old is None:
        del os.environ["NEFFKIT_GGUF_CACHE"]
    else:
        os.environ["NEFFKIT_GGUF_CACHE"] = old


@pytest.fixture(scope="module")
def tiny(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Llama's GGUF file and its metadata directory."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return path, gguf_model_dir(path)


def _manifest(model: Path) -> dict:
    return {"neffkit": 1, "model": str(model), "buckets": SMALL}


def test_the_source_reads_what_transformers_makes_of_each_tensor(tiny, tmp_path):
    """Every tensor, quantized ones dequantized, equals `neffkit convert`'s (gguf-py's values
    through transformers' processor: Llama's q/k rope permutation included)."""
    from safetensors.torch import load_file

    path, model = tiny
    source = gguf_source(model)
    assert source is not None
    convert_gguf(path, tmp_path / "float")
    expected = load_file(str(tmp_path / "float" / "model.safetensors"))
    assert source.names == set(expected)
    for name in sorted(source.names):
        value = source.read(name)
        if isinstance(value, QuantTensor):
            assert source.dtype(name) == "Q" and source.scheme(name) == value.scheme
            value = value.dequantized()
        assert torch.equal(value, expected[name]), name
    source.close()


def test_a_gguf_file_is_a_model_directory_made_once_per_content(tiny, cache, tmp_path):
    path, model = tiny
    manifest = parse_manifest(_manifest(path), tmp_path)
    assert manifest.model == model and model.parent == cache and (model / POINTER).is_file()
    assert {p.name for p in model.iterdir()} >= {"config.json", "tokenizer.json", POINTER}
    assert not list(model.glob("*.safetensors"))  # the weights stay in the file
    cfg = manifest.model_config
    assert cfg.weight_format == "gguf" and cfg.architecture == "LlamaForCausalLM"
    pointer = json.loads((model / POINTER).read_text())
    assert dict(cfg.weight_format_options)["sha256"] == pointer["sha256"]
    assert pointer["gguf"] == str(path.resolve())
    stamp = (model / POINTER).stat().st_mtime_ns
    copy = tmp_path / "copy.gguf"  # the same content elsewhere: the same directory
    shutil.copyfile(path, copy)
    assert parse_manifest(_manifest(copy), tmp_path).model == model
    assert (model / POINTER).stat().st_mtime_ns == stamp  # the first copy is still there
    try:  # the file the pointer names is gone: the copy given now is read instead
        (model / POINTER).write_text(json.dumps({**pointer, "gguf": str(tmp_path / "gone")}))
        assert gguf_model_dir(copy) == model
        assert json.loads((model / POINTER).read_text())["gguf"] == str(copy.resolve())
    finally:
        (model / POINTER).write_text(json.dumps(pointer))
    assert not [p for p in cache.iterdir() if p.is_dir() and p.name.startswith(".")]  # staged


def test_the_file_content_is_in_every_cache_key(tiny, cache, tmp_path):
    """Two files alike but for their tensors: different model configs, different trace keys;
    a file changed under a directory made from it is refused, not read."""
    from neffkit.compile.backends import get_backend
    from neffkit.compile.cache.keys import trace_key
    from neffkit.compile.plan import make_plan

    def key(path: Path) -> str:
        manifest = parse_manifest(_manifest(path), tmp_path)
        spec = make_plan(manifest).graphs[0]
        return trace_key(manifest, get_backend("cpu"), spec, 0).digest

    other = write_tiny_llama(tmp_path / "other.gguf", seed=1)
    assert key(tiny[0]) != key(other)
    model = gguf_model_dir(other)
    shutil.copyfile(tiny[0], other)
    with pytest.raises(ModelError, match="changed since"):
        gguf_source(model)


def test_types_neffkit_does_not_keep_are_refused_by_name(cache, tmp_path):
    path = write_tiny_llama(
        tmp_path / "q2.gguf", {"blk.0.attn_q": "Q2_K", "blk.1.ffn_up": "IQ4_NL"}
    )
    with pytest.raises(ManifestError) as err:
        parse_manifest(_manifest(path), tmp_path)
    message = str(err.value)
    assert "model:" in message and "'blk.0.attn_q.weight'" in message and "Q2_K" in message
    assert "1 more" in message and "neffkit convert" in message


def test_a_missing_gguf_file_is_named(cache, tmp_path):
    with pytest.raises(ManifestError, match="model: GGUF file .*none.gguf does not exist"):
        parse_manifest(_manifest(tmp_path / "none.gguf"), tmp_path)


def test_transformers_own_gguf_config_is_refused(tmp_path):
    """A model saved by transformers after loading a GGUF file: its weights are not the file."""
    cfg = {"quantization_config": {"quant_method": "gguf", "gguf_file": "m.gguf"}}
    with pytest.raises(ModelError, match="quant_method 'gguf'") as err:
        weight_format(cfg, tmp_path / "config.json")
    assert "model: FILE.gguf" in (err.value.hint or "")
