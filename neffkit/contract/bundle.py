"""The bundle on disk (format 1): write and read `bundle.json`, hash and verify every file.

The records themselves are in records.py, staging directories in staging.py, packs in pack.py.

A bundle is a directory usable in place:
  bundle.json   format, versions, target, host requirements, resolved manifest, model config,
                layout, graphs, weights, files{path: sha256}
  graphs/       compiled artifacts, one per graph
  ir/           canonical graph text per graph, zstd-compressed
  weights/      rank{r}.safetensors, pre-sharded
  tokenizer/    copied from the model directory when present

Every path bundle.json names is relative and stays inside the bundle (`..`, absolute paths and
links out of it are refused: docs/bundle-format.md#paths). Imports neither neffkit.compile nor
neffkit.runtime (nor torch): both sides depend on this contract. A compiled artifact is
executable code; never load a bundle from a source you do not trust.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import zstandard

from neffkit.contract.records import FORMAT_VERSION, BundleRecord, GraphRecord
from neffkit.errors import BundleError

BUNDLE_JSON = "bundle.json"
SHA256 = re.compile("[0-9a-f]{64}")
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
    """Open a bundle directory; check its format, its paths and (by default) every file's sha256.
    (`contract.read.read_bundle` opens packs too.)"""
    meta = root / BUNDLE_JSON
    if not root.exists():
        raise BundleError(
            f"{root}: does not exist (a bundle is the directory `neffkit build` wrote)",
            hint="check the path; `neffkit build MANIFEST -o DIR` writes one",
        )
    if not root.is_dir():
        raise BundleError(
            f"{root}: not a directory (a bundle is the directory `neffkit build` wrote)"
        )
    if not meta.exists():
        raise BundleError(
            f"{root}: no {BUNDLE_JSON}; this is not a neffkit bundle",
            hint="build one with `neffkit build MANIFEST`",
        )
    bundle = Bundle(root, parse_bundle_json(meta.read_bytes(), str(meta)))
    if verify:
        verify_files(bundle)
    return bundle


def parse_bundle_json(raw: bytes, where: str) -> BundleRecord:
    """bundle.json's bytes as its record: the format checked, and every path it names confined
    to the bundle (`where` names the file in errors)."""
    try:
        data = json.loads(raw)
    except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
        raise BundleError(f"{where}: corrupt JSON: {exc}", hint="rebuild the bundle") from exc
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt != FORMAT_VERSION:
        raise BundleError(
            f"{where}: bundle format {fmt!r} is not supported; this neffkit reads format "
            f"{FORMAT_VERSION}",
            hint="rebuild the bundle with this neffkit, or install the neffkit that built it",
        )
    try:
        record = BundleRecord.from_json(data)
        _check_paths(record, where)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BundleError(
            f"{where}: bundle.json does not match format {FORMAT_VERSION} ({exc!r} is missing or "
            "malformed)",
            hint="rebuild the bundle with this neffkit",
        ) from exc
    return record


def _check_paths(record: BundleRecord, where: str) -> None:
    """Every file's hash is a sha256, and every path stays inside the bundle."""
    for rel, sha in record.files.items():
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):
            raise BundleError(f"{where}: files[{rel!r}] is {sha!r}, not a sha256 (64 hex digits)")
    for field, value in record_paths(record):
        if not inside_path(value) or (field == "files" and value == BUNDLE_JSON):
            raise BundleError(
                f"{where}: {field} {value!r} is not a path inside the bundle",
                hint="every path in bundle.json is relative, without `..`, and stays inside the "
                "bundle (docs/bundle-format.md#paths): this bundle.json was altered, or not "
                "written by neffkit",
            )


def inside_path(value: object) -> bool:
    """A relative POSIX path that stays where it is joined: no leading `/`, no `..`, `.` or
    empty part, no backslash or NUL."""
    if not isinstance(value, str) or not value or value.startswith("/"):
        return False
    if "\\" in value or "\0" in value:
        return False
    return all(part not in ("", ".", "..") for part in value.split("/"))


def record_paths(record: BundleRecord) -> Iterator[tuple[str, object]]:
    """Every path a bundle's records name, with its field: what a reader joins to the root."""
    for rel in record.files:
        yield "files", rel
    for i, g in enumerate(record.graphs):
        for name in ("artifact", "ir", "hlo", "hlo_text"):
            value = getattr(g, name)
            if value is not None or name == "ir":
                yield f"graphs[{i}].{name}", value
    for i, w in enumerate(record.weights):
        yield f"weights[{i}].file", w.file
    if record.tokenizer is not None:
        yield "tokenizer", record.tokenizer
    for i, kernel in enumerate(record.kernels):
        yield f"kernels[{i}]", kernel
    speculation = record.layout.speculation
    if speculation is not None and speculation.draft:
        yield "layout.speculation.draft", speculation.draft


def verify_files(bundle: Bundle, only: Iterable[str] | None = None, workers: int = 4) -> None:
    """Listed files exist inside the bundle (no link out of it) with their recorded hashes (all
    of them, or `only` those: what one rank reads), hashed in parallel threads (hashlib releases
    the GIL); and no listed graph file is missing."""
    files = bundle.record.files
    chosen = sorted(files if only is None else set(only) & set(files))
    root = bundle.root.resolve()
    for rel in chosen:
        path = bundle.root / rel
        if not path.is_file():
            raise BundleError(
                f"{bundle.root}: file {rel} is missing",
                hint="the bundle is incomplete; copy it again or rebuild",
            )
        if not path.resolve().is_relative_to(root):
            raise BundleError(
                f"{bundle.root}: file {rel} links outside the bundle (to {path.resolve()})",
                hint="a bundle's files lie inside its directory (docs/bundle-format.md#paths)",
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
    check_graphs_listed(bundle.record, str(bundle.root))


def check_graphs_listed(record: BundleRecord, where: str) -> None:
    """Every graph's file is among the listed (hashed) files."""
    for graph in record.graphs:
        # a lowered neuron bundle has no artifact yet: its HLO module must be there instead
        if (graph.artifact or graph.hlo) not in record.files:
            raise BundleError(f"{where}: graph {graph.name} has no listed artifact")
