"""The bundle on disk (format 1): write and read `bundle.json`, hash and verify every file.

The records themselves are in records.py, staging directories in staging.py, packs in pack.py.

A bundle is a directory usable in place:
  bundle.json   format, versions, target, host requirements, resolved manifest, model config,
                layout, graphs, weights, files{path: sha256}
  graphs/       compiled artifacts, one per graph
  ir/           canonical graph text per graph, zstd-compressed
  weights/      rank{r}.safetensors, pre-sharded
  tokenizer/    copied from the model directory when present

Imports neither neffkit.compile nor neffkit.runtime (nor torch): both sides depend on this contract.
A compiled artifact is executable code; never load a bundle from a source you do not trust.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import zstandard

from neffkit.contract.records import FORMAT_VERSION, BundleRecord, GraphRecord
from neffkit.errors import BundleError

BUNDLE_JSON = "bundle.json"
PACK_SUFFIX = ".tar.zst"  # a bundle as one file (contract/pack.py)


def is_pack(path: Path) -> bool:
    """A packed bundle (BUNDLE.tar.zst), which read_bundle extracts, rather than a directory."""
    return path.is_file() and path.name.endswith(PACK_SUFFIX)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_zst_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # level and no threads: the same text always gives the same bytes
    path.write_bytes(zstandard.ZstdCompressor(level=10).compress(text.encode()))


def read_zst_text(path: Path) -> str:
    return zstandard.ZstdDecompressor().decompress(path.read_bytes()).decode()


def list_files(root: Path) -> list[str]:
    """Every file below `root` except its own bundle.json, as sorted POSIX relative paths (a
    draft model's bundle.json inside it is listed: its hash pins the draft's files)."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p != root / BUNDLE_JSON
    )


def write_bundle_json(root: Path, record: BundleRecord) -> BundleRecord:
    """Hash every file in `root` into the record's `files`; write bundle.json (sorted, stable)."""
    record = replace(
        record,
        format=FORMAT_VERSION,
        files={rel: sha256_file(root / rel) for rel in list_files(root)},
    )
    (root / BUNDLE_JSON).write_text(json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n")
    return record


@dataclass(frozen=True)
class Bundle:
    """An opened bundle: where it is and its typed record."""

    root: Path
    record: BundleRecord

    @property
    def target(self) -> str:
        return self.record.target

    @property
    def graphs(self) -> tuple[GraphRecord, ...]:
        return self.record.graphs

    @property
    def digest(self) -> str:
        """sha256 of bundle.json: names this exact bundle (files included, through their hashes)."""
        return sha256_file(self.root / BUNDLE_JSON)

    def path(self, rel: str) -> Path:
        return self.root / rel


def rank_files(record: BundleRecord, rank: int) -> list[str]:
    """The files one rank reads when it loads: its graphs, its weight shard, the tokenizer."""
    graphs = [g.artifact or g.hlo or "" for g in record.graphs if g.serves(rank)]
    prefix = f"{record.tokenizer}/" if record.tokenizer else None
    tokenizer = [f for f in record.files if prefix and f.startswith(prefix)]
    return [*graphs, *record.kernels, record.weights_of(rank).file, *tokenizer]


def read_bundle_dir(root: Path, verify: bool = True) -> Bundle:
    """Open a bundle directory; check its format and (by default) every file's sha256.
    (`contract.read.read_bundle` opens packs too.)"""
    meta = root / BUNDLE_JSON
    if not root.is_dir():
        raise BundleError(
            f"{root}: not a directory (a bundle is the directory `neffkit build` wrote)"
        )
    if not meta.exists():
        raise BundleError(
            f"{root}: no {BUNDLE_JSON}; this is not a neffkit bundle",
            hint="build one with `neffkit build MANIFEST`",
        )
    try:
        data = json.loads(meta.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{meta}: corrupt JSON: {exc}", hint="rebuild the bundle") from exc
    fmt = data.get("format")
    if fmt != FORMAT_VERSION:
        raise BundleError(
            f"{meta}: bundle format {fmt!r} is not supported; this neffkit reads format "
            f"{FORMAT_VERSION}",
            hint="rebuild the bundle with this neffkit, or install the neffkit that built it",
        )
    try:
        record = BundleRecord.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(
            f"{meta}: bundle.json does not match format {FORMAT_VERSION} ({exc!r} is missing or "
            "malformed)",
            hint="rebuild the bundle with this neffkit",
        ) from exc
    bundle = Bundle(root, record)
    if verify:
        verify_files(bundle)
    return bundle


def verify_files(bundle: Bundle, only: Iterable[str] | None = None, workers: int = 4) -> None:
    """Listed files exist with their recorded hashes (all of them, or `only` those: what one
    rank reads), hashed in parallel threads (hashlib releases the GIL); and no listed graph
    file is missing."""
    files = bundle.record.files
    chosen = sorted(files if only is None else set(only) & set(files))
    for rel in chosen:
        if not (bundle.root / rel).is_file():
            raise BundleError(
                f"{bundle.root}: file {rel} is missing",
                hint="the bundle is incomplete; copy it again or rebuild",
            )
    with ThreadPoolExecutor(max_workers=workers) as pool:
        hashes = pool.map(lambda rel: sha256_file(bundle.root / rel), chosen)
        actual = dict(zip(chosen, hashes, strict=True))
    for rel in chosen:
        if actual[rel] != files[rel]:
            raise BundleError(
                f"{bundle.root}: file {rel} is corrupt (sha256 {actual[rel][:12]}…, expected "
                f"{files[rel][:12]}…)",
                hint="the bundle was modified or damaged in transit; copy it again or rebuild",
            )
    for graph in bundle.graphs:
        # a lowered neuron bundle has no artifact yet: its HLO module must be there instead
        if (graph.artifact or graph.hlo) not in files:
            raise BundleError(f"{bundle.root}: graph {graph.name} has no listed artifact")
