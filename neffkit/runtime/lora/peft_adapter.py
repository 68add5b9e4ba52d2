"""Read a PEFT LoRA adapter directory (`save_pretrained`'s adapter_config.json and
adapter_model.safetensors) into the tensors a bundle's LoRA slots take.

Everything an adapter could ask for that the slots cannot compute (DoRA, biases, extra trained
modules, per-module ranks, embedding adapters, ...) is refused by name before a tensor is read:
serving such an adapter as plain LoRA would answer with a different model, silently. Key names
and scaling follow peft 0.21.2 (tuners/lora/layer.py, utils/save_and_load.py); pickle
(adapter_model.bin) is never loaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from neffkit.contract.lora import COLUMN, LoraRecord, LoraTarget
from neffkit.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # a real config is ~1 KiB; anything near this is not one
KEY_PREFIX = "base_model.model."  # what PeftModel.state_dict() puts before the base model's names
EMBEDDING_MODULES = ("embed_tokens", "lm_head")  # peft's EMBEDDING_LAYER_NAMES
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names
# config fields whose set value makes the adapter compute something the slots cannot (a LoRA
# variant, a bias, other modules' weights, another layer stack): field → what it is
UNSUPPORTED = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "adapters that also save whole modules are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights are not supported",
    "rank_pattern": "per-module ranks are not supported",
    "alpha_pattern": "per-module alphas are not supported",
    "lora_bias": "LoRA biases are not supported",
    "trainable_token_indices": "embedding adapters are not supported",
    "target_parameters": "adapters on parameters (MoE experts) are not supported",
    "layer_replication": "layer replication is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA adapters are not supported",
    "monteclora_config": "MonteCLoRA adapters are not supported",
}
# init_lora_weights values that rewrite the base weights: the adapter needs that rewritten base
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True)
class Adapter:
    """An adapter ready for the slots: per adapted prefix, A [in, max_rank] and B [max_rank, out]
    in float32, whole (unsplit), the rank zero-padded to max_rank and the scaling folded into B,
    so that x @ A @ B is PEFT's delta `lora_B(lora_A(x)) * scaling`."""

    name: str
    path: Path
    rank: int  # the adapter's r
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Host memory the folded tensors hold (what a loaded-adapter cache counts)."""
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


@dataclass(frozen=True)
class _Where:
    """The adapter being read, so that every refusal names it and the file at fault."""

    name: str
    path: Path

    def error(self, file: str | None, message: str, hint: str | None = None) -> AdapterError:
        where = f"adapter {self.name!r} ({self.path}): " + (f"{file}: " if file else "")
        return AdapterError(where + message, hint)


def read_adapter(name: str, path: str | Path, lora: LoraRecord) -> Adapter:
    """Validate the adapter at `path` against the bundle's `lora` and fold it for the slots."""
    where = _Where(name, Path(path).expanduser())
    weights_file = _check_files(where)
    config = _read_config(where)
    _check_supported(where, config)
    rank, scaling = _check_rank(where, config, lora)
    targeted = _check_target_modules(where, config, lora)
    raw = _read_tensors(where, weights_file, lora, rank, targeted)
    weights = {prefix: _fold(a, b, scaling, lora.max_rank) for prefix, (a, b) in raw.items()}
    return Adapter(name, where.path, rank, scaling, weights)


def shard(
    a: torch.Tensor, b: torch.Tensor, target: LoraTarget, rank: int, tp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's part, cut as the base projection is (`target.span`): column split → B's
    columns, row split → A's rows; the other factor whole."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not one of tp {tp}'s ranks")
    start, size = target.span(rank) if tp > 1 else (0, None)
    if target.split == COLUMN:
        return a.contiguous(), b[:, start : None if size is None else start + size].contiguous()
    return a[start : None if size is None else start + size].contiguous(), b.contiguous()


def _check_files(where: _Where) -> Path:
    if not where.path.is_dir():
        raise where.error(None, "not a directory (a PEFT adapter is a save_pretrained directory)")
    if not (where.path / CONFIG_FILE).is_file():
        raise where.error(CONFIG_FILE, "missing (a PEFT adapter directory holds one)")
    weights_file = where.path / WEIGHTS_FILE
    if weights_file.is_file():
        return weights_file
    if (where.path / PICKLE_FILE).is_file():
        raise where.error(
            PICKLE_FILE,
            f"pickle weights are never loaded; convert it with safetensors to {WEIGHTS_FILE}",
            hint="save_pretrained(..., safe_serialization=True) writes safetensors",
        )
    raise where.error(WEIGHTS_FILE, "missing")


def _read_config(where: _Where) -> dict[str, Any]:
    config_file = where.path / CONFIG_FILE
    size = config_file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise where.error(CONFIG_FILE, f"{size} bytes is above the limit of {MAX_CONFIG_BYTES}")
    try:
        config = json.loads(config_file.read_bytes())
    except (UnicodeDecodeError, ValueError) as e:
        raise where.error(CONFIG_FILE, f"not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise where.error(CONFIG_FILE, f"expected a JSON object, got {type(config).__name__}")
    return config


def _check_supported(where: _Where, config: dict[str, Any]) -> None:
    """Refuse every setting under which PEFT computes something other than x @ A @ B."""
    if config.get("peft_type") != "LORA":
        raise where.error(CONFIG_FILE, f"peft_type {config.get('peft_type')!r} is not 'LORA'")
    for field, why in UNSUPPORTED.items():
        if config.get(field):
            raise where.error(CONFIG_FILE, f"{field} {config[field]!r}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise where.error(CONFIG_FILE, f"bias {bias!r}: only 'none' is supported (no biases)")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise where.error(
            CONFIG_FILE,
            f"init_lora_weights {init!r} rewrites the base weights; this bundle's are unchanged",
            hint="save it with save_pretrained(path_initial_model_for_weight_conversion=...)",
        )


def _check_rank(where: _Where, config: dict[str, Any], lora: LoraRecord) -> tuple[int, float]:
    """(r, scaling) as peft's LoraLayer.update_layer computes them (defaults: r 8, alpha 8)."""
    rank = config.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise where.error(CONFIG_FILE, f"r {rank!r} is not an integer >= 1")
    if rank > lora.max_rank:
        raise where.error(
            CONFIG_FILE,
            f"r {rank} is above this bundle's lora.max_rank {lora.max_rank}",
            hint="serve it from a bundle built with a larger lora.max_rank",
        )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise where.error(CONFIG_FILE, f"lora_alpha {alpha!r} is not a number > 0")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise where.error(CONFIG_FILE, f"use_rslora {rslora!r} is not true or false")
    return rank, alpha / math.sqrt(rank) if rslora else alpha / rank


def _check_target_modules(where: _Where, config: dict[str, Any], lora: LoraRecord) -> list[str]:
    """The config's target_modules entries. peft matches a list entry against a module's whole
    name or a dotted suffix of it ("all-linear" is saved as whole names), and a string as a
    regex over whole names, which is refused unless it is a plain module name."""
    entries = config.get("target_modules")
    if isinstance(entries, str):
        if entries not in lora.modules:
            raise where.error(
                CONFIG_FILE,
                f"target_modules {entries!r}: a regex is not supported; "
                f"list module names out of {', '.join(lora.modules)}",
            )
        return [entries]
    if not isinstance(entries, list) or not entries:
        raise where.error(CONFIG_FILE, f"target_modules {entries!r} is not a list of module names")
    for entry in entries:
        if not isinstance(entry, str):
            raise where.error(CONFIG_FILE, f"target_modules entry {entry!r} is not a string")
        module = entry.rsplit(".", 1)[-1]
        if module in EMBEDDING_MODULES:
            raise where.error(
                CONFIG_FILE, f"target_modules {entry!r}: embedding adapters are not supported"
            )
        if module not in lora.modules:
            raise where.error(
                CONFIG_FILE,
                f"target_modules {entry!r} is not adapted by this bundle; "
                f"it adapts {', '.join(lora.modules)}",
            )
    return entries


def _read_tensors(
    where: _Where, weights_file: Path, lora: LoraRecord, rank: int, targeted: list[str]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each adapted prefix's (lora_A [r, in], lora_B [out, r]) as saved, in float32, every key,
    shape and dtype checked from the header before a tensor is read. numpy, not torch: a
    hundred small tensors' ops cost a tenth as much, and a load happens between decode steps."""
    try:
        with safe_open(weights_file, framework="numpy") as f:
            keys = _index_keys(where, f, lora, rank, targeted)
            offsets: dict[str, Any] = {}  # the header, read once where a tensor is bf16
            read = {
                prefix: (_array(f, a, weights_file, offsets), _array(f, b, weights_file, offsets))
                for prefix, (a, b) in keys.items()
            }
    except SafetensorError as e:
        raise where.error(WEIGHTS_FILE, f"not a valid safetensors file ({e})") from None
    for prefix, pair in read.items():
        for key, values in zip(keys[prefix], pair, strict=True):
            if not np.isfinite(values).all():
                raise where.error(WEIGHTS_FILE, f"{key} holds values that are not finite")
    return read


def _array(f: Any, key: str, path: Path, header: dict[str, Any]) -> np.ndarray:
    """A tensor as float32 (bf16, which numpy lacks, from its bits: exact). `header`: the
    file's, once read (safetensors' format: a little-endian length, the JSON header, data)."""
    piece = f.get_slice(key)
    if piece.get_dtype() != "BF16":
        return np.asarray(f.get_tensor(key), dtype=np.float32)
    with path.open("rb") as raw:
        if not header:
            size = int.from_bytes(raw.read(8), "little")
            header.update(json.loads(raw.read(size)), __data__=8 + size)
        start, end = header[key]["data_offsets"]
        raw.seek(header["__data__"] + start)
        bits = np.frombuffer(raw.read(end - start), dtype="<u2")
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(piece.get_shape())


def _index_keys(
    where: _Where, f: Any, lora: LoraRecord, rank: int, targeted: list[str]
) -> dict[str, tuple[str, str]]:
    """prefix → (its lora_A key, its lora_B key), from the safetensors header alone."""
    targets = {t.prefix: t for t in lora.targets}
    found: dict[str, dict[str, str]] = {}
    for key in f.keys():
        prefix, factor = _parse_key(where, key, targets, targeted)
        target, piece = targets[prefix], f.get_slice(key)
        want = [rank, target.in_features] if factor == "lora_A" else [target.out_features, rank]
        if list(piece.get_shape()) != want:
            shape = list(piece.get_shape())
            raise where.error(WEIGHTS_FILE, f"{key} has shape {shape}, expected {want} (r {rank})")
        if piece.get_dtype() not in FLOAT_DTYPES:
            expected = ", ".join(FLOAT_DTYPES)
            raise where.error(
                WEIGHTS_FILE, f"{key} has dtype {piece.get_dtype()}, expected one of {expected}"
            )
        found.setdefault(prefix, {})[factor] = key
    if not found:
        raise where.error(WEIGHTS_FILE, "holds no LoRA weights")
    for prefix, pair in found.items():
        for factor in ("lora_A", "lora_B"):
            if factor not in pair:
                raise where.error(WEIGHTS_FILE, f"{KEY_PREFIX}{prefix}.{factor}.weight is missing")
    return {prefix: (pair["lora_A"], pair["lora_B"]) for prefix, pair in found.items()}


def _parse_key(
    where: _Where, key: str, targets: dict[str, LoraTarget], targeted: list[str]
) -> tuple[str, str]:
    """`base_model.model.<prefix>.lora_A.weight` → (prefix, "lora_A"); anything else is refused
    (peft 0.21.2 saves no adapter name in the key)."""
    if "lora_embedding_" in key:
        raise where.error(WEIGHTS_FILE, f"{key}: embedding adapters are not supported")
    body, _, tail = key.removeprefix(KEY_PREFIX).rpartition(".")
    prefix, _, factor = body.rpartition(".")
    if not key.startswith(KEY_PREFIX) or tail != "weight" or factor not in ("lora_A", "lora_B"):
        wanted = f"{KEY_PREFIX}<module>.lora_A.weight or .lora_B.weight"
        raise where.error(WEIGHTS_FILE, f"unexpected key {key!r} (expected {wanted})")
    if prefix.rsplit(".", 1)[-1] in EMBEDDING_MODULES:
        raise where.error(WEIGHTS_FILE, f"{key}: embedding adapters are not supported")
    if prefix not in targets:
        raise where.error(WEIGHTS_FILE, f"{key}: {prefix} is not a projection this bundle adapts")
    if not any(prefix == e or prefix.endswith(f".{e}") for e in targeted):
        raise where.error(WEIGHTS_FILE, f"{key}: {prefix} is not in {CONFIG_FILE}'s target_modules")
    return prefix, factor


def _fold(
    a: np.ndarray, b: np.ndarray, scaling: float, max_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's lora_A [r, in] and lora_B [out, r] → A [in, max_rank], B [max_rank, out] (float32,
    zero beyond r, B times scaling): x @ A @ B == lora_B(lora_A(x)) * scaling."""
    rank = a.shape[0]
    folded_a = np.zeros((a.shape[1], max_rank), dtype=np.float32)
    folded_b = np.zeros((max_rank, b.shape[0]), dtype=np.float32)
    folded_a[:, :rank] = a.T
    folded_b[:rank] = b.T * np.float32(scaling)
    return torch.from_numpy(folded_a), torch.from_numpy(folded_b)
