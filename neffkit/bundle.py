"""The bundle on disk (format 1): write and read `bundle.json`, hash and verify every file.

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
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from neffkit.errors import BundleError

FORMAT_VERSION = 1
BUNDLE_JSON = "bundle.json"


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
    """Every file below `root` except bundle.json, as sorted POSIX relative paths."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != BUNDLE_JSON
    )


def write_bundle_json(root: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in `root` into data["files"] and write bundle.json (sorted, stable)."""
    data = dict(data)
    data["format"] = FORMAT_VERSION
    data["files"] = {rel: sha256_file(root / rel) for rel in list_files(root)}
    (root / BUNDLE_JSON).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


@dataclass(frozen=True)
class Bundle:
    root: Path
    data: dict[str, Any]

    @property
    def target(self) -> str:
        return self.data["target"]

    @property
    def graphs(self) -> list[dict[str, Any]]:
        return self.data["graphs"]

    @property
    def digest(self) -> str:
        """sha256 of bundle.json: names this exact bundle (files included, through their hashes)."""
        return sha256_file(self.root / BUNDLE_JSON)

    def path(self, rel: str) -> Path:
        return self.root / rel


def read_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Open a bundle directory; check its format and (by default) every file's sha256."""
    root = Path(path)
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
    bundle = Bundle(root, data)
    if verify:
        verify_files(bundle)
    return bundle


def verify_files(bundle: Bundle) -> None:
    """Every listed file exists with its recorded hash, and no listed graph file is missing."""
    files: dict[str, str] = bundle.data.get("files", {})
    for rel, expected in files.items():
        file = bundle.root / rel
        if not file.is_file():
            raise BundleError(
                f"{bundle.root}: file {rel} is missing",
                hint="the bundle is incomplete; copy it again or rebuild",
            )
        actual = sha256_file(file)
        if actual != expected:
            raise BundleError(
                f"{bundle.root}: file {rel} is corrupt (sha256 {actual[:12]}…, expected "
                f"{expected[:12]}…)",
                hint="the bundle was modified or damaged in transit; copy it again or rebuild",
            )
    for graph in bundle.data.get("graphs", []):
        # a lowered neuron bundle has no artifact yet: its HLO module must be there instead
        needed = graph.get("artifact") or graph.get("hlo")
        if needed not in files:
            raise BundleError(f"{bundle.root}: graph {graph['name']} has no listed artifact")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(parent: Path, prefix: str) -> None:
    """Remove `<prefix><pid>-*` temp dirs whose process is gone (a SIGKILLed build)."""
    if not parent.is_dir():
        return
    for path in parent.glob(f"{prefix}*"):
        pid_text = path.name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staging_dir(dest: Path) -> Iterator[Path]:
    """A temp directory beside `dest`, renamed onto `dest` only if the block completes.

    On any exception (Ctrl-C included) the temp directory is removed and `dest` is untouched, so a
    failed build never leaves a half-written bundle.
    """
    dest = dest.resolve()
    if dest.exists() and not (dest / BUNDLE_JSON).exists():
        raise BundleError(
            f"{dest}: exists and is not a bundle; refusing to overwrite it",
            hint="choose another output directory with -o",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(dest.parent, f".{dest.name}.tmp-")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            old = Path(
                tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-old-", dir=dest.parent)
            )
            os.replace(dest, old / "bundle")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
