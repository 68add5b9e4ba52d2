"""Read a manifest file (schema 1): YAML → validated, fully resolved Manifest.

Every error names the field path and the bad value and says what was expected. Unknown keys are
errors. Relative paths resolve against the manifest's folder. Imports no torch and nothing from
neffkit.compile: target names and audit rule ids come from the leaf module neffkit.targets.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from neffkit.checkpoints.gguf_dir import POINTER, gguf_model_dir
from neffkit.errors import ManifestError, ModelError, NeffkitError
from neffkit.manifest.fields import choice, describe, mapping, no_unknown
from neffkit.manifest.hub import hub_id, resolve, snapshot_revision
from neffkit.manifest.lora import read_lora
from neffkit.manifest.quantization import read_quantization
from neffkit.manifest.schema import SCHEMA_VERSION, Manifest, Speculation
from neffkit.manifest.sections import (
    read_audit,
    read_buckets,
    read_compiler,
    read_kv_cache,
    read_lm_head,
    read_mla,
    read_neuron,
    read_parallel,
    read_sampling,
    read_speculation,
)
from neffkit.manifest.task import read_task
from neffkit.models.config import ModelConfig, check_static, max_length
from neffkit.models.parallel import Parallelism
from neffkit.models.registry import mtp_model_config, read_model_config
from neffkit.targets import DTYPES, TARGETS

TOP_LEVEL = (
    "neffkit",
    "name",
    "model",
    "dtype",
    "target",
    "neuron",
    "parallel",
    "kv_cache",
    "buckets",
    "sampling",
    "compiler",
    "audit",
    "mla",
    "decode_state",
    "quantization",
    "speculation",
    "lm_head",
    "lora",
    "task",
    "embedding",
)
DECODE_STATES = ("host", "device")


def _model_dir(value: Any, base: Path, field: str = "model") -> tuple[Path, ModelConfig]:
    """An HF checkpoint directory, a Hub id's snapshot (manifest/hub.py) or a GGUF file's
    (`field` names it in errors), and its validated config."""
    if not isinstance(value, str) or not value:
        raise ManifestError(
            f"{field}: expected a path to an HF model directory or a .gguf file, got "
            f"{describe(value)}"
        )
    path = (base / value).resolve()
    ref = hub_id(value)
    if path.suffix.lower() == ".gguf":
        path = _gguf_dir(path, field)
    elif ref is not None and not path.exists():  # org/name[@revision]: through the Hub's cache
        path = resolve(*ref, field)
    if not path.is_dir():
        raise ManifestError(f"{field}: directory {path} does not exist")
    if not (path / "config.json").exists():
        raise ManifestError(f"{field}: {path} has no config.json (is it an HF model directory?)")
    if not any(path.glob("*.safetensors")) and not (path / POINTER).is_file():
        raise ManifestError(
            f"{field}: {path} has no *.safetensors files",
            hint="save the model with save_pretrained(..., safe_serialization=True)",
        )
    try:
        return path, read_model_config(path)
    except ModelError as exc:
        raise ManifestError(f"{field}: {exc.message}", exc.hint) from exc


def _gguf_dir(path: Path, field: str) -> Path:
    """A GGUF file's metadata directory, which the rest of neffkit reads as the model (made once
    per file content; the tensors stay in the file: checkpoints/gguf_dir.py)."""
    if not path.is_file():
        raise ManifestError(f"{field}: GGUF file {path} does not exist")
    try:
        return gguf_model_dir(path)
    except NeffkitError as exc:
        raise ManifestError(f"{field}: {exc.message}", exc.hint) from exc


def _header(data: Any, name: str) -> tuple[dict[str, Any], str]:
    """The document as a mapping with its required keys and schema checked, and its name."""
    data = mapping(data, "manifest")
    no_unknown(data, TOP_LEVEL, "")
    for key in ("neffkit", "model", "buckets"):
        if key not in data:
            raise ManifestError(f"{key}: required field is missing")
    if data["neffkit"] != SCHEMA_VERSION:
        raise ManifestError(
            f"neffkit: unsupported manifest schema {data['neffkit']!r}; this neffkit reads schema "
            f"{SCHEMA_VERSION}"
        )
    display_name = data.get("name", name)
    if not isinstance(display_name, str) or not display_name:
        raise ManifestError(f"name: expected a non-empty string, got {describe(display_name)}")
    return data, display_name


def parse_manifest(data: Any, base: Path, name: str = "manifest") -> Manifest:
    """Validate a parsed YAML document; `base` is the folder relative paths resolve against."""
    data, display_name = _header(data, name)
    dtype = choice(data.get("dtype", "float32"), DTYPES, "dtype")
    target = choice(data.get("target", "cpu"), TARGETS, "target")
    neuron = read_neuron(data, target)
    parallel = read_parallel(data.get("parallel", {}))
    embedding = read_task(data)
    buckets = read_buckets(data["buckets"], decode=embedding is None)
    sampling = read_sampling(data.get("sampling", {}))
    compiler = read_compiler(data.get("compiler", {}), "compiler")
    audit = read_audit(data.get("audit", {}))
    model_path, model_config = _model_dir(data["model"], base)
    if embedding is not None:  # pooled hidden states: no LM head read, stored or required
        model_config = replace(model_config, lm_head=False)
    _check_model(model_config, parallel, buckets, sampling)
    _check_length(model_config, buckets, model_path)
    return Manifest(
        name=display_name,
        model=model_path,
        model_revision=snapshot_revision(model_path),
        dtype=dtype,
        target=target,
        neuron=neuron,
        parallel=parallel,
        kv_cache=read_kv_cache(data.get("kv_cache", {}), buckets, dtype, model_config, parallel),
        buckets=buckets,
        sampling=sampling,
        compiler=compiler,
        model_config=model_config,
        audit=audit,
        mla_decode=read_mla(data.get("mla", {}), model_config),
        decode_state=choice(
            data.get("decode_state", "device" if target == "neuron" and not embedding else "host"),
            DECODE_STATES,
            "decode_state",
        ),
        speculation=_speculation(
            data.get("speculation"), buckets, base, (model_path, model_config), parallel, sampling
        ),
        lm_head_dtype=read_lm_head(data.get("lm_head", {}), model_config, model_path),
        quantization=read_quantization(data.get("quantization"), model_config, model_path),
        lora=read_lora(data.get("lora"), model_config),
        embedding=embedding,
    )


def _speculation(
    value: Any,
    buckets: Any,
    base: Path,
    model: tuple[Path, ModelConfig],
    parallel: Any,
    sampling: Any,
) -> Speculation | None:
    """The `speculation` section; a draft model's checkpoint read and checked against the
    target's: the draft proposes token ids the target verifies, so both must mean the same
    vocabulary, and the draft (or the MTP layer) runs in the target's process (one rank)."""
    spec = read_speculation(value, buckets)
    if spec is None or spec.method == "ngram":
        return spec
    if parallel.tp > 1:
        raise ManifestError(
            f"speculation.method: a {spec.method} proposer runs on one rank; this manifest has "
            f"parallel.tp {parallel.tp}",
            hint="build the bundle with tp 1, or use method ngram at tp > 1",
        )
    target_path, target = model
    if spec.method == "mtp":  # the checkpoint's own multi-token prediction layer
        try:
            return replace(spec, model=target_path, model_config=mtp_model_config(target))
        except ModelError as exc:
            raise ManifestError(f"speculation.method: {exc.message}", exc.hint) from exc
    path, cfg = _model_dir(value.get("model"), base, "speculation.model")
    if cfg.vocab_size != target.vocab_size:
        raise ManifestError(
            f"speculation.model: the draft's vocabulary ({cfg.vocab_size} tokens, {path}) "
            f"differs from the target's ({target.vocab_size})",
            hint="a draft model must share the target's tokenizer (docs/serving.md#draft-models)",
        )
    try:  # the draft's own limits (its rope's reach over the context buckets, ...)
        _check_model(cfg, Parallelism(), buckets, sampling)
    except ManifestError as exc:
        raise ManifestError(
            f"speculation.model (the draft, {path}): {exc.message}", exc.hint
        ) from exc
    return replace(spec, model=path, model_config=cfg)


def _check_model(cfg: ModelConfig, parallel: Any, buckets: Any, sampling: Any) -> None:
    """What the model allows of the layout, the buckets and the sampling section."""
    try:
        cfg.check_parallelism(parallel)
    except ModelError as exc:  # models/ knows the layout, the manifest knows where it was set
        raise ManifestError(f"{exc.field or 'parallel'}: {exc.message}", exc.hint) from exc
    static_rope = check_static(cfg.rope_params, buckets.context[-1])
    if static_rope is not None:
        raise ManifestError(f"buckets.context: {static_rope}")
    if sampling.max_logprobs > cfg.vocab_size:
        raise ManifestError(
            f"sampling.max_logprobs: {sampling.max_logprobs} exceeds the vocabulary "
            f"({cfg.vocab_size} tokens)"
        )


def _check_length(cfg: ModelConfig, buckets: Any, model_path: Path) -> None:
    """No context bucket past the length the checkpoint declares: positions it never trained on
    give garbage without an error (vLLM refuses them too, unless told otherwise)."""
    found = max_length(cfg.rope_params)
    if found is None or buckets.allow_long_context:
        return
    limit, where = found
    for i, context in enumerate(buckets.context):
        if context > limit:
            raise ManifestError(
                f"buckets.context[{i}]: {context} exceeds the model's maximum length {limit}: "
                f"{where} in {model_path / 'config.json'}",
                hint=f"keep context buckets <= {limit}, or set buckets.allow_long_context: true "
                "if the model handles longer sequences (docs/manifest.md#buckets)",
            )


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: manifest file not found") from exc
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc}") from exc
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not a text file (a manifest is YAML)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: invalid YAML: {exc}") from exc
    manifest = parse_manifest(data, path.parent.resolve(), name=path.stem)
    return replace(manifest, source=path.resolve())
