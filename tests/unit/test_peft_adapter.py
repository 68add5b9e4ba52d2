"""neffkit.runtime.lora.peft_adapter against peft itself (the oracle, no mocks): adapters that
peft 0.21.2 saves from a tiny Llama are read back, and x @ A @ B must equal each peft layer's
`lora_B(lora_A(x)) * scaling`; every adapter the slots cannot serve is refused by name, written
by peft where peft can write it, by hand where it cannot."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from neffkit.contract.lora import COLUMN, ROW, LoraRecord, LoraTarget
from neffkit.errors import AdapterError
from neffkit.runtime.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter, shard

SPLITS = {
    "q_proj": COLUMN,
    "k_proj": COLUMN,
    "v_proj": COLUMN,
    "o_proj": ROW,
    "gate_proj": COLUMN,
    "up_proj": COLUMN,
    "down_proj": ROW,
}
MAX_RANK = 16
KEY = "base_model.model.model.layers.0.self_attn.q_proj"  # a key's stem in the `saved` adapter


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    return LlamaForCausalLM(config)


@cache
def bundle_lora(modules: tuple[str, ...] = tuple(SPLITS)) -> LoraRecord:
    """The `lora:` a bundle of the tiny Llama would hold: every Linear of `modules`, its shape as
    HF has it, split as the manifest splits it."""
    targets = tuple(
        LoraTarget(name, layer.in_features, layer.out_features, SPLITS[name.rsplit(".", 1)[-1]])
        for name, layer in tiny_llama().named_modules()
        if isinstance(layer, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules
    )
    return LoraRecord(4, MAX_RANK, modules, "float32", targets)


def save_adapter(path: Path, **config: Any) -> PeftModel:
    """A peft adapter with random A and B (init_lora_weights=False: B is not zero) at `path`."""
    torch.manual_seed(1)
    with warnings.catch_warnings():  # peft's and transformers' own notes on what is saved
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_llama(), LoraConfig(init_lora_weights=False, **config))
        model.save_pretrained(path)
    return model


def assert_matches_peft(model: PeftModel, path: Path, rank: int, scaling: float) -> None:
    """Every adapted Linear's delta, through the folded factors and through peft's own layer."""
    adapter = read_adapter("sql", path, bundle_lora())
    assert (adapter.name, adapter.path, adapter.rank) == ("sql", path, rank)
    assert adapter.scaling == pytest.approx(scaling)
    layers = {
        name.removeprefix("base_model.model."): layer
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer)
    }
    assert set(adapter.weights) == set(layers)
    for prefix, layer in layers.items():
        a, b = adapter.weights[prefix]
        assert a.dtype == b.dtype == torch.float32
        assert a.shape == (layer.in_features, MAX_RANK) and b.shape == (
            MAX_RANK,
            layer.out_features,
        )
        assert not a[:, rank:].any() and not b[rank:].any()  # the padding beyond r
        assert layer.scaling["default"] == pytest.approx(scaling)
        x = torch.randn(3, layer.in_features)
        with torch.no_grad():
            want = layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
            torch.testing.assert_close(x @ a @ b, want)
            torch.testing.assert_close((a @ b).T, layer.get_delta_weight("default"))
    assert adapter.nbytes == sum(
        4 * MAX_RANK * (a.shape[0] + b.shape[1]) for a, b in adapter.weights.values()
    )


@pytest.mark.parametrize("rank", [4, 8, 16])
def test_every_projection_reproduces_peft(tmp_path: Path, rank: int) -> None:
    model = save_adapter(tmp_path, r=rank, lora_alpha=32, target_modules=list(SPLITS))
    assert_matches_peft(model, tmp_path, rank, 32 / rank)


def test_rslora_scales_by_the_square_root_of_r(tmp_path: Path) -> None:
    model = save_adapter(tmp_path, r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj"])
    assert_matches_peft(model, tmp_path, 8, 16 / math.sqrt(8))


def test_default_alpha_is_peft_s(tmp_path: Path) -> None:
    model = save_adapter(tmp_path, r=4, target_modules=["q_proj"])
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    del config["lora_alpha"]  # peft's default, 8, as LoraConfig.from_pretrained fills it in
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    assert_matches_peft(model, tmp_path, 4, 8 / 4)


def test_a_subset_of_targets_returns_only_those(tmp_path: Path) -> None:
    model = save_adapter(tmp_path, r=4, target_modules=["v_proj", "down_proj"])
    assert_matches_peft(model, tmp_path, 4, 8 / 4)
    adapter = read_adapter("sql", tmp_path, bundle_lora())
    assert {p.rsplit(".", 1)[-1] for p in adapter.weights} == {"v_proj", "down_proj"}
    assert len(adapter.weights) == 4


def test_layers_to_transform_leaves_the_other_layers_out(tmp_path: Path) -> None:
    model = save_adapter(
        tmp_path, r=4, target_modules=["q_proj", "o_proj"], layers_to_transform=[1]
    )
    assert_matches_peft(model, tmp_path, 4, 8 / 4)
    assert sorted(read_adapter("sql", tmp_path, bundle_lora()).weights) == [
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.self_attn.q_proj",
    ]


def test_all_linear_is_saved_as_whole_names_and_accepted(tmp_path: Path) -> None:
    model = save_adapter(tmp_path, r=4, target_modules="all-linear")
    assert (
        "model.layers.0.mlp.down_proj"
        in json.loads((tmp_path / CONFIG_FILE).read_text())["target_modules"]
    )
    assert_matches_peft(model, tmp_path, 4, 8 / 4)


def test_a_plain_module_name_string_is_accepted(tmp_path: Path) -> None:
    model = save_adapter(tmp_path, r=4, target_modules=["q_proj"])
    edit_config(tmp_path, target_modules="q_proj")
    assert_matches_peft(model, tmp_path, 4, 8 / 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_come_back_float32(tmp_path: Path, dtype: torch.dtype) -> None:
    save_adapter(tmp_path, r=4, lora_alpha=8, target_modules=["q_proj"])
    edit_tensors(tmp_path, lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    saved = load_file(tmp_path / WEIGHTS_FILE)
    adapter = read_adapter("sql", tmp_path, bundle_lora())
    a, b = adapter.weights["model.layers.0.self_attn.q_proj"]
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a[:, :4], saved[f"{KEY}.lora_A.weight"].float().T)
    torch.testing.assert_close(b[:4], saved[f"{KEY}.lora_B.weight"].float().T * 2)


@pytest.mark.parametrize(("module", "split"), [("q_proj", COLUMN), ("o_proj", ROW)])
def test_shard_splits_as_the_base_projection_does(tmp_path: Path, module: str, split: str) -> None:
    save_adapter(tmp_path, r=8, target_modules=[module])
    target = next(t for t in bundle_lora().targets if t.prefix.endswith(f"0.self_attn.{module}"))
    assert target.split == split
    a, b = read_adapter("sql", tmp_path, bundle_lora()).weights[target.prefix]
    half = (target.out_features if split == COLUMN else target.in_features) // 2
    target = dataclasses.replace(target, spans=((0, half), (half, half)))  # the build's tp=2 cut
    parts = [shard(a, b, target, rank, 2) for rank in range(2)]
    n_in, n_out = target.local(2)
    for part_a, part_b in parts:
        assert part_a.shape == (n_in, MAX_RANK) and part_b.shape == (MAX_RANK, n_out)
        assert part_a.is_contiguous() and part_b.is_contiguous()
    x = torch.randn(3, target.in_features)
    if split == COLUMN:  # each rank: all inputs, its outputs
        assert all(torch.equal(part_a, a) for part_a, _ in parts)
        assert torch.equal(torch.cat([part_b for _, part_b in parts], dim=1), b)
        outputs = torch.cat([x @ pa @ pb for pa, pb in parts], dim=1)
    else:  # each rank: its inputs, partial sums of all outputs (the all-reduce adds them)
        assert all(torch.equal(part_b, b) for _, part_b in parts)
        assert torch.equal(torch.cat([part_a for part_a, _ in parts], dim=0), a)
        outputs = sum(x[:, r * n_in : (r + 1) * n_in] @ pa @ pb for r, (pa, pb) in enumerate(parts))
    torch.testing.assert_close(outputs, x @ a @ b)
    with pytest.raises(ValueError, match="rank 2"):
        shard(a, b, target, 2, 2)


# ---- refusals ----------------------------------------------------------------------------------


def refused(path: Path, *needles: str, lora: LoraRecord | None = None) -> str:
    """The message of the AdapterError reading `path` raises: it names the adapter and path."""
    with pytest.raises(AdapterError) as info:
        read_adapter("bad", path, lora or bundle_lora())
    message = info.value.message
    assert message.startswith(f"adapter 'bad' ({path}): "), message
    for needle in needles:
        assert needle in message, message
    return message


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps({**config, **changes}))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One good adapter (r 8 on q_proj and o_proj); tests edit their own copy of it."""
    path = tmp_path_factory.mktemp("saved")
    save_adapter(path, r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"])
    return path


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "adapter"))


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (dict(use_dora=True), "use_dora"),
        (dict(bias="lora_only"), "bias 'lora_only'"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=["q_proj", "embed_tokens"]), "embedding adapters are not supported"),
        (dict(r=32), "r 32 is above this bundle's lora.max_rank 16"),
        (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
        (dict(lora_bias=True), "lora_bias"),
    ],
)
def test_peft_written_adapters_it_cannot_serve(tmp_path: Path, config: dict, needle: str) -> None:
    save_adapter(tmp_path, **{"target_modules": ["q_proj"], **config})
    refused(tmp_path, f"{CONFIG_FILE}: ", needle)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not 'LORA'"),
        ({"peft_type": None}, "peft_type None"),
        ({"use_dora": True}, "use_dora True: DoRA adapters are not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
        ({"bias": "all"}, "bias 'all'"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out True"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern {'q_proj': 4}"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern {'q_proj': 4}"),
        ({"r": 32}, "r 32 is above this bundle's lora.max_rank 16"),
        ({"r": 0}, "r 0 is not an integer >= 1"),
        ({"r": "8"}, "r '8' is not an integer"),
        ({"r": 2.5}, "r 2.5 is not an integer"),
        ({"r": True}, "r True is not an integer"),
        ({"lora_alpha": 0}, "lora_alpha 0 is not a number > 0"),
        ({"lora_alpha": -16}, "lora_alpha -16"),
        ({"lora_alpha": "16"}, "lora_alpha '16'"),
        ({"lora_alpha": math.nan}, "lora_alpha nan"),
        ({"use_rslora": "yes"}, "use_rslora 'yes' is not true or false"),
        ({"target_modules": r".*\.q_proj"}, "a regex is not supported"),
        ({"target_modules": "all-linear"}, "target_modules 'all-linear'"),
        (
            {"target_modules": ["q_proj", "rotary"]},
            "'rotary' is not adapted by this bundle; it "
            "adapts q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        ),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embedding adapters are not supported"),
        ({"target_modules": ["lm_head"]}, "'lm_head': embedding adapters are not supported"),
        ({"target_modules": None}, "target_modules None"),
        ({"target_modules": []}, "target_modules []"),
        ({"target_modules": ["q_proj", 3]}, "target_modules entry 3"),
        ({"lora_bias": True}, "lora_bias True"),
        ({"trainable_token_indices": [1, 2]}, "embedding adapters are not supported"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
        ({"alora_invocation_tokens": [5, 6]}, "aLoRA"),
        ({"use_qalora": True}, "use_qalora"),
        ({"use_bdlora": {"nblocks": 2}}, "use_bdlora"),
        ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights 'pissa_niter_4' rewrites"),
        ({"init_lora_weights": "olora"}, "init_lora_weights 'olora' rewrites"),
    ],
)
def test_config_refusals(copy: Path, changes: dict[str, Any], needle: str) -> None:
    edit_config(copy, **changes)
    refused(copy, f"{CONFIG_FILE}: ", needle)


def test_modules_the_bundle_does_not_adapt(copy: Path) -> None:
    lora = bundle_lora(("q_proj", "v_proj"))
    refused(copy, "'o_proj' is not adapted by this bundle; it adapts q_proj, v_proj", lora=lora)


def test_files_and_directories(tmp_path: Path, copy: Path) -> None:
    refused(tmp_path / "nowhere", "not a directory")
    (tmp_path / "a_file").write_text("{}")
    refused(tmp_path / "a_file", "not a directory")
    (copy / CONFIG_FILE).rename(tmp_path / "config.json")
    refused(copy, f"{CONFIG_FILE}: missing")
    (tmp_path / "config.json").rename(copy / CONFIG_FILE)
    (copy / WEIGHTS_FILE).rename(copy / "adapter_model.bin")  # never unpickled, only refused
    refused(copy, "adapter_model.bin: ", "convert it with safetensors")
    (copy / "adapter_model.bin").unlink()
    refused(copy, f"{WEIGHTS_FILE}: missing")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"r": 8,', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (b"{}" + b" " * (1 << 20), "bytes is above the limit of 1048576"),
    ],
)
def test_unreadable_configs(copy: Path, content: bytes, needle: str) -> None:
    (copy / CONFIG_FILE).write_bytes(content)
    refused(copy, f"{CONFIG_FILE}: ", needle)


def test_malformed_safetensors(copy: Path) -> None:
    whole = (copy / WEIGHTS_FILE).read_bytes()
    (copy / WEIGHTS_FILE).write_bytes(whole[:-100])  # the header promises more than is there
    refused(copy, f"{WEIGHTS_FILE}: not a valid safetensors file")
    (copy / WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    refused(copy, f"{WEIGHTS_FILE}: not a valid safetensors file")


def rename(old: str, new: str) -> Callable[[dict[str, torch.Tensor]], object]:
    return lambda t: t.update({new: t.pop(old)})


def put(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], object]:
    return lambda t: t.update({key: value})


A, B = f"{KEY}.lora_A.weight", f"{KEY}.lora_B.weight"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (put(f"{KEY}.lora_magnitude_vector", torch.ones(64)), f"'{KEY}.lora_magnitude_vector'"),
        (put(f"{KEY}.lora_B.bias", torch.ones(64)), f"unexpected key '{KEY}.lora_B.bias'"),
        (put("base_model.model.lm_head.weight", torch.ones(256, 64)), "'base_model.model.lm_he"),
        (rename(A, f"{KEY}.lora_A.default.weight"), f"'{KEY}.lora_A.default.weight'"),
        (rename(A, A.removeprefix("base_model.model.")), "unexpected key 'model.layers.0"),
        (
            put("base_model.model.model.embed_tokens.lora_embedding_A", torch.ones(8, 256)),
            "embed_tokens.lora_embedding_A: embedding adapters are not supported",
        ),
        (
            put("base_model.model.lm_head.lora_A.weight", torch.ones(8, 64)),
            "lm_head.lora_A.weight: embedding adapters are not supported",
        ),
        (
            rename(A, A.replace("layers.0", "layers.5")),
            "model.layers.5.self_attn.q_proj is not a projection this bundle adapts",
        ),
        (rename(A, A.replace("q_proj", "k_proj")), "k_proj is not in adapter_config.json's targ"),
        (lambda t: t.pop(B), f"{B} is missing"),
        (put(A, torch.ones(4, 64)), f"{A} has shape [4, 64], expected [8, 64] (r 8)"),
        (put(B, torch.ones(32, 8)), f"{B} has shape [32, 8], expected [64, 8] (r 8)"),
        (put(A, torch.ones(8, 64, dtype=torch.int64)), f"{A} has dtype I64"),
        (put(A, torch.full((8, 64), math.nan)), f"{A} holds values that are not finite"),
        (put(B, torch.full((64, 8), math.inf, dtype=torch.float16)), f"{B} holds values that"),
        (lambda t: t.clear(), "holds no LoRA weights"),
    ],
)
def test_tensor_refusals(copy: Path, edit: Callable[[dict], object], needle: str) -> None:
    edit_tensors(copy, edit)
    refused(copy, f"{WEIGHTS_FILE}: ", needle)
