"""A GGUF file read through transformers, two ways: `neffkit convert` writes an HF checkpoint
directory with the tensors dequantized (config.json, model.safetensors, tokenizer, chat
template); `model: FILE.gguf` gets the same directory without the weights, the tensors read
from the file at their width (gguf_dir.py, gguf_source.py).

transformers does the model-specific parts (the config from GGUF metadata, the GGUF → HF tensor
names, each architecture's tensor fix-ups such as Llama's q/k rope permutation and Gemma's norm
offset, the tokenizer), so a file read here loads exactly as `from_pretrained(dir,
gguf_file=...)` loads it. `convert` dequantizes with gguf-py straight into the safetensors file,
without instantiating the model: seconds, where `from_pretrained` + `save_pretrained` takes a
minute (and refuses to save a model it loaded from GGUF).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import NeffkitError

RECORD = "neffkit-convert.json"  # what the directory was converted from (a rerun's cache check)
RECORD_FORMAT = 1


@dataclass(frozen=True)
class Converted:
    out: Path
    architecture: str
    tensors: int
    parameters: int
    reused: bool  # the directory already held this file's conversion


@dataclass
class GgufModel:
    """A GGUF file as transformers reads it: what both ways of using it share."""

    source: Path
    reader: Any  # gguf.GGUFReader (the tensors, memory-mapped)
    config: Any  # the transformers config, without a quantization_config
    parsed: dict[str, Any]  # load_gguf_checkpoint's: "config" is what the processors read
    arch: str  # the GGUF architecture (general.architecture)
    processor: Any  # transformers' TensorProcessor of the architecture
    names: dict[str, str]  # GGUF tensor name → HF name
    wanted: set[str]  # the HF model's tensor names
    model_class: str  # the HF class (LlamaForCausalLM, ...)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _require() -> tuple[Any, Any]:
    try:
        import gguf
        import transformers
    except ImportError as exc:
        raise NeffkitError(
            f"reading GGUF files needs {exc.name}: pip install 'neffkit[gguf]'"
        ) from None
    return gguf, transformers


def processor_for(arch: str, config: dict[str, Any]) -> Any:
    """transformers' tensor processor of a GGUF architecture (the fix-ups its loader applies)."""
    _require()
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)


def open_gguf(source: Path) -> GgufModel:
    """The file's config, tensor names and processor, as transformers' GGUF loader has them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    gguf, _ = _require()
    folder, name = str(source.parent), source.name
    try:
        parsed = load_gguf_checkpoint(str(source), return_tensors=False)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        reader = gguf.GGUFReader(str(source))
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise NeffkitError(f"{source}: transformers cannot read this GGUF file ({exc})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # neffkit says how the tensors are stored
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = processor_for(arch, parsed["config"])
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    return GgufModel(
        source=source,
        reader=reader,
        config=config,
        parsed=parsed,
        arch=arch,
        processor=processor,
        names=names,
        wanted=set(skeleton.state_dict()),
        model_class=type(skeleton).__name__,
    )


def write_metadata(
    model: GgufModel, stage: Path, dtype: str, quantization: dict[str, Any] | None = None
) -> None:
    """config.json (with `quantization` as its quantization_config), generation_config.json,
    the tokenizer and its chat template into `stage`."""
    from transformers import AutoTokenizer, GenerationConfig

    config = model.config
    config.dtype = dtype
    config.architectures = [model.model_class]  # what from_pretrained would record
    if quantization is not None:
        config.quantization_config = quantization
    config.save_pretrained(stage)
    if quantization is not None:
        del config.quantization_config
    GenerationConfig.from_model_config(config).save_pretrained(stage)
    source = model.source
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(stage)


def _previous(out: Path, sha: str) -> dict[str, Any] | None:
    try:
        record = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return None
    same = record.get("sha256") == sha and record.get("format") == RECORD_FORMAT
    return record if same else None


def convert_gguf(source: Path, out: Path, *, dtype: str = "float32") -> Converted:
    """Convert `source` into the directory `out` (written whole or not at all). A directory that
    already holds this file's conversion (same sha256) is kept as it is."""
    if not source.is_file():
        raise NeffkitError(f"{source}: no such GGUF file")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise NeffkitError(f"--dtype: expected float32, bfloat16 or float16, got {dtype!r}")
    sha = sha256_file(source)
    if (previous := _previous(out, sha)) is not None and previous.get("dtype") == dtype:
        return Converted(
            out, previous["architecture"], previous["tensors"], previous["parameters"], reused=True
        )
    _require()
    stage = out.with_name(f".{out.name}.converting-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        result = _convert_into(source, stage, dtype)
        record = {
            "format": RECORD_FORMAT,
            "source": source.name,
            "sha256": sha,
            "dtype": dtype,
            "architecture": result.architecture,
            "tensors": result.tensors,
            "parameters": result.parameters,
        }
        (stage / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return Converted(out, result.architecture, result.tensors, result.parameters, reused=False)


def _convert_into(source: Path, stage: Path, dtype: str) -> Converted:
    import torch
    from safetensors.torch import save_file

    gguf, _ = _require()
    model = open_gguf(source)
    parsed, names = model.parsed, model.names
    target = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    parsed["tensors"] = {}  # where the MoE processors put the experts they split or stack
    for tensor in model.reader.tensors:
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = model.processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if result.name not in names:
            continue
        hf_name = names[result.name]
        tensors[hf_name] = torch.from_numpy(result.weights.copy()).to(target).contiguous()
    for hf_name, value in parsed["tensors"].items():
        tensors[hf_name] = value.to(target).contiguous()
    missing = model.wanted - set(tensors)
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise NeffkitError(f"{source}: the GGUF file has no tensor for {sorted(missing)[:5]}")
    save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
    (stage / "model.safetensors").chmod(0o644)
    write_metadata(model, stage, dtype)
    parameters = sum(t.numel() for t in tensors.values())
    return Converted(stage, model.arch, len(tensors), parameters, reused=False)
