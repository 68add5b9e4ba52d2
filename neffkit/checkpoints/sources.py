"""A checkpoint as the weight pipeline reads it (models/weights.py): its tensors by HF name from
whichever source holds them (safetensors, with a quantized format's weights decoded; a GGUF
file; quantized by the manifest), with the K/V scales a build calibrated beside them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from neffkit.checkpoints.quantized import Format, QuantTensor, SafetensorsSource, Source
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme
from neffkit.kernels.quant import expand_scales
from neffkit.models.config import ModelConfig
from neffkit.models.forms import Storage

QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I8", "U8", "I32")


def _check_tensor(name: str, dtype: str, cfg: ModelConfig, names: set[str]) -> None:
    """A quantized tensor widened without its scales is silently wrong: refuse it by name,
    unless the config declares fp8 and the tensor's scales are there (integer formats come
    decoded: their stored tensors never reach here)."""
    if dtype.upper() not in QUANTIZED_DTYPES:
        return
    if cfg.fp8_block and dtype.upper() == "F8_E4M3":
        if name + cfg.fp8_scale_suffix not in names:
            raise ModelError(f"fp8 tensor {name!r} has no {name + cfg.fp8_scale_suffix!r}")
        return
    raise ModelError(
        f"tensor {name!r} is stored as {dtype} and the checkpoint's quantization_config says "
        "nothing neffkit reads about it (neffkit reads float weights, fp8 ones with their "
        "scales, and AWQ, GPTQ, compressed-tensors int, mxfp4 and GGUF checkpoints)",
        hint="docs/models.md lists the quantized formats neffkit reads",
    )


def open_source(model_dir: Path, cfg: ModelConfig, storage: Storage) -> Source:
    """The checkpoint's tensors by HF name: a GGUF file's, or a safetensors checkpoint's with
    its format's quantized weights decoded; quantized by the manifest where it asks."""
    from neffkit.checkpoints.gguf_source import gguf_source

    source: Source | None = gguf_source(model_dir)
    if source is None:
        source = SafetensorsSource(model_dir, _format(model_dir, cfg))
    for name in source.names:
        _check_tensor(name, source.dtype(name), cfg, source.names)
    if storage.quantize:
        from neffkit.checkpoints.requantize import QuantizingSource

        source = QuantizingSource(
            source, storage.quantize, storage.quantize_exclude, cfg.tie_word_embeddings
        )
    return source


def _format(model_dir: Path, cfg: ModelConfig) -> Format | None:
    if not cfg.weight_format:
        return None
    from neffkit.checkpoints.formats import format_for
    from neffkit.models.config import read_config_json

    quant = read_config_json(model_dir).get("quantization_config") or {}
    return format_for(cfg.weight_format, quant)


class Checkpoint:
    """A source's tensors with the build's calibrated ones beside them; `read` keeps the
    source's QuantTensors (int_cuts cuts their parts), `expanded_scale` an fp8 weight's
    scale one per element."""

    def __init__(
        self, source: Source, cfg: ModelConfig, calibrated: dict[str, torch.Tensor]
    ) -> None:
        self.source, self.cfg, self.calibrated = source, cfg, calibrated
        self.names = set(source.names) | set(calibrated)
        self.quantized = any(source.scheme(n) is not None for n in source.names)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.calibrated:
            return tuple(self.calibrated[name].shape)
        return self.source.shape(name)

    def dtype(self, name: str) -> str:
        return "F32" if name in self.calibrated else self.source.dtype(name)

    def scheme(self, name: str) -> QuantScheme | None:
        return None if name in self.calibrated else self.source.scheme(name)

    def read(self, name: str) -> torch.Tensor | QuantTensor:
        if name in self.calibrated:
            value = self.calibrated[name]
            if value.is_meta:
                raise ModelError(f"{name}: the fp8 KV cache was never calibrated")
            return value
        return self.source.read(name)

    def expanded_scale(self, name: str) -> torch.Tensor:
        """Per element scale of an fp8 tensor; a stand-in of the right shape for the others."""
        if name in self.calibrated:
            return torch.empty(self.calibrated[name].shape, device="meta")
        scale_name = name + self.cfg.fp8_scale_suffix
        weight_shape = list(self.source.shape(name))
        if scale_name not in self.source.names:
            return torch.empty(weight_shape, device="meta")
        scale = self.source.read(scale_name)
        assert isinstance(scale, torch.Tensor)
        return expand_scales(scale, weight_shape, self.cfg.fp8_block)

    def close(self) -> None:
        self.source.close()
