"""`model: FILE.gguf`: the GGUF file as an HF model directory without weights, made once per
file content (sha256) in the GGUF cache, so the rest of neffkit reads it like any checkpoint.

The directory holds what transformers makes of the file's metadata (config.json,
generation_config.json, the tokenizer and its chat template: gguf.py) and `neffkit-gguf.json`,
the pointer: the file's path, size and sha256, transformers' architecture and processor config,
and each tensor the HF model reads (its GGUF name, type, shape and byte range), so a build reads
tensors straight from the file (gguf_source.py) without parsing its metadata again. config.json's
quantization_config is `{"quant_method": "gguf", "neffkit_pointer": ..., "sha256": ...}`: the
file's content is part of the model config, hence of every cache key a build makes.

The cache is $NEFFKIT_GGUF_CACHE, else `gguf/` in a local $NEFFKIT_CACHE, else
~/.cache/neffkit/gguf; each directory is written whole or not at all (staged, then renamed).
A file's sha256 is remembered by its path, size, mtime and inode, so an unchanged file is hashed
once. Pure Python at import (the manifest imports it); transformers only when a directory is made.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from neffkit.errors import ModelError, NeffkitError

POINTER = "neffkit-gguf.json"
POINTER_FORMAT = 1
# the GGUF types a tensor keeps (gguf_blocks.BLOCK_TYPES decodes the quantized ones)
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
CONVERT_HINT = "convert the file to float first (neffkit convert FILE.gguf -o DIR) and build DIR"


def cache_root() -> Path:
    """$NEFFKIT_GGUF_CACHE, else gguf/ in a local $NEFFKIT_CACHE, else ~/.cache/neffkit/gguf."""
    if os.environ.get("NEFFKIT_GGUF_CACHE"):
        return Path(os.environ["NEFFKIT_GGUF_CACHE"]).expanduser()
    base = os.environ.get("NEFFKIT_CACHE", "")
    if base and ("://" not in base or base.startswith("file://")):
        return Path(base.removeprefix("file://")).expanduser() / "gguf"
    return Path.home() / ".cache" / "neffkit" / "gguf"


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def content_sha(path: Path) -> str:
    """The file's sha256, hashed once per (path, size, mtime, inode)."""
    from neffkit.checkpoints.gguf import sha256_file

    st = path.stat()
    stamp = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    memo = cache_root() / "stamps" / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    sha = sha256_file(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    _replace_file(memo, sha + "\n")
    return sha


def read_pointer(model_dir: Path) -> dict[str, Any] | None:
    """The directory's pointer record (None: not a GGUF directory, or one of another format)."""
    try:
        record = json.loads((model_dir / POINTER).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("format") == POINTER_FORMAT
    return record if ok else None


def gguf_model_dir(path: Path) -> Path:
    """The metadata directory of the GGUF file `path` (made if this content has none yet); a
    tensor the model reads that neffkit cannot keep is refused by name (ModelError)."""
    if not path.is_file():
        raise NeffkitError(f"{path}: no such GGUF file")
    path = path.resolve()
    sha = content_sha(path)
    out = cache_root() / sha[:16]
    record = read_pointer(out)
    if record is None or record.get("sha256") != sha:
        with _locked(out):  # one process makes it; the others wait, then read it
            record = read_pointer(out)
            if record is None or record.get("sha256") != sha:
                _make(path, sha, out)
                record = read_pointer(out)
        assert record is not None
    elif record["gguf"] != str(path) and not _same_content(Path(record["gguf"]), sha):
        record["gguf"] = str(path)  # the first copy seen is gone: read this one
        _replace_file(out / POINTER, json.dumps(record, indent=1) + "\n")
    check_record(record)
    return out


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_name(f".{out.name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _same_content(path: Path, sha: str) -> bool:
    try:
        return path.is_file() and content_sha(path) == sha
    except OSError:
        return False


def check_record(record: dict[str, Any]) -> None:
    """Refuse a file with a tensor the model reads that neffkit cannot keep (by name)."""
    refused = [(hf, t) for hf, t in record["tensors"].items() if t.get("refused")]
    if not refused:
        return
    hf, t = refused[0]
    more = f" (and {len(refused) - 1} more tensors)" if len(refused) > 1 else ""
    raise ModelError(
        f"{record['gguf']}: tensor {t['name']!r} ({hf}) {t['refused']}{more}; neffkit reads "
        f"GGUF tensors as {', '.join(QUANT_TYPES)} (kept quantized) or {', '.join(FLOAT_TYPES)}",
        hint=CONVERT_HINT,
    )


def _make(path: Path, sha: str, out: Path) -> None:
    """Write the directory of this content whole (staged beside it, then renamed)."""
    from neffkit.checkpoints.gguf import open_gguf, write_metadata

    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.making-*"):  # killed makers' (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    stage = out.with_name(f".{out.name}.making-{os.getpid()}")
    stage.mkdir()
    try:
        model = open_gguf(path)
        tensors = _table(model)
        types = Counter(t["type"] for t in tensors.values())
        quantization = {
            "quant_method": "gguf",
            "neffkit_pointer": POINTER,
            "sha256": sha,
            "tensor_types": dict(sorted(types.items())),
        }
        write_metadata(model, stage, "float32", quantization)
        record = {
            "format": POINTER_FORMAT,
            "gguf": str(path),
            "size": path.stat().st_size,
            "sha256": sha,
            "architecture": model.arch,
            "processor_config": model.parsed["config"],
            "tensors": tensors,
        }
        (stage / POINTER).write_text(json.dumps(record, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # a broken one, or of an older format
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _table(model: Any) -> dict[str, dict[str, Any]]:
    """HF name → the GGUF tensor it is read from: name, type, shape, byte range, and why it is
    refused (a type neffkit does not keep, or a fix-up that is more than a row order)."""
    tensors: dict[str, dict[str, Any]] = {}
    for tensor in model.reader.tensors:
        hf = model.names.get(tensor.name)
        if hf is None:
            continue  # nothing the HF model reads (rope_freqs, ...)
        kind = tensor.tensor_type.name
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        refused = None
        if kind not in QUANT_TYPES + FLOAT_TYPES:
            refused = f"is stored as {kind}"
        else:
            try:
                row_order(model.processor, tensor.name, tuple(shape), model.names, kind)
            except ValueError as exc:
                refused = str(exc)
        tensors[hf] = {
            "name": tensor.name,
            "type": kind,
            "shape": shape,
            "offset": int(tensor.data_offset),
            "nbytes": int(tensor.n_bytes),
            "refused": refused,
        }
    missing = model.wanted - set(tensors)
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise NeffkitError(f"{model.source}: the GGUF file has no tensor for {sorted(missing)[:5]}")
    return tensors


def row_order(
    processor: Any, name: str, shape: tuple[int, ...], names: dict[str, str], kind: str
) -> Any:
    """What transformers' processor does to a tensor's rows, found by running it on the row
    numbers: the order (numpy int64 over the rows of all leading dims) or None (as stored).
    A float tensor may have its values changed too (Gemma's norms: the source runs the processor
    on them); a quantized one only its rows reordered (Llama's q/k): anything else, a renamed,
    merged or reshaped tensor, is a ValueError saying what."""
    import numpy as np

    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0]
    probe_shape = (*shape[:-1], 1) if len(shape) > 1 else (rows,)
    probe = np.arange(1, rows + 1, dtype=np.float64).reshape(probe_shape)
    scratch: dict[str, Any] = {"tensors": {}, "config": {}}
    result = processor.process(
        weights=probe.copy(), name=name, tensor_key_mapping=names, parsed_parameters=scratch
    )
    if result.name != name or scratch["tensors"]:
        raise ValueError("is merged with other tensors by transformers' GGUF loader")
    out = np.asarray(result.weights)
    if out.shape != probe.shape:
        raise ValueError(f"is reshaped by transformers' GGUF loader ({shape} → {out.shape})")
    if kind in FLOAT_TYPES:
        return None
    flat = out.reshape(-1)
    order = flat.astype(np.int64) - 1
    if not (np.array_equal(np.sort(flat), probe.reshape(-1)) and np.array_equal(order + 1, flat)):
        raise ValueError("has its values changed by transformers' GGUF loader, not only its rows")
    return None if np.array_equal(order, np.arange(rows)) else order
