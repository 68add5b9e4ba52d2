"""Content-addressed artifact cache: a local directory (local.py) or any filesystem fsspec reaches
(remote.py), keyed by every factor that changes an artifact (keys.py); lookup.py is the build's
view of it. `open_cache` picks the store. A read-only cache (`--cache-readonly`: serving hosts,
untrusted CI) is looked up but never written, corrupt entries included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.compile.cache.local import ArtifactCache

if TYPE_CHECKING:
    from neffkit.compile.cache.remote import RemoteArtifactCache

    Cache = ArtifactCache | RemoteArtifactCache  # one interface, two stores


def default_cache_dir() -> str:
    """$NEFFKIT_CACHE (a directory or an fsspec URL), else ~/.cache/neffkit."""
    return os.environ.get("NEFFKIT_CACHE") or str(Path.home() / ".cache" / "neffkit")


def is_url(location: str | Path) -> bool:
    return isinstance(location, str) and "://" in location


def open_cache(location: str | Path, readonly: bool = False) -> ArtifactCache | RemoteArtifactCache:
    """The cache at `location`: a local directory (`file://` included), or an fsspec URL."""
    if is_url(location) and not str(location).startswith("file://"):
        from neffkit.compile.cache.remote import RemoteArtifactCache

        return RemoteArtifactCache(str(location), readonly)
    path = str(location).removeprefix("file://")
    return ArtifactCache(Path(path).expanduser(), readonly)
