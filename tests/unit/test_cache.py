"""The artifact cache's publishing rules, local and through fsspec (no builds: see test_build for
whole builds through a cache, an S3-compatible one included)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest

from neffkit.compile.cache import open_cache
from neffkit.compile.cache.local import KEY_JSON, ArtifactCache
from neffkit.compile.cache.remote import RemoteArtifactCache
from neffkit.compile.units import CacheKey, TraceResult
from neffkit.contract.tempdirs import owned_temp_dir
from neffkit.errors import BuildError

KEY = CacheKey({"graph": "g", "flags": ["-O2"]})


def _artifact(tmp_path: Path, data: bytes = b"compiled graph", name: str = "g.pt2") -> Path:
    path = tmp_path / "made" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def remote(tmp_path: Path) -> tuple[str, Path]:
    """A fresh prefix of fsspec's in-memory filesystem (a real fsspec store) and a mirror dir."""
    return f"memory://neffkit-test-{uuid.uuid4().hex}/cache", tmp_path / "mirror"


def _files(url: str) -> dict[str, bytes]:
    fs, base = fsspec.core.url_to_fs(url)
    return {p[len(base) :]: fs.cat_file(p) for p in fs.find(base)}


def test_open_cache_picks_the_store(tmp_path, remote, monkeypatch):
    monkeypatch.setenv("NEFFKIT_CACHE_MIRROR", str(remote[1]))
    assert isinstance(open_cache(tmp_path / "a"), ArtifactCache)
    local = open_cache(f"file://{tmp_path}/b")
    assert isinstance(local, ArtifactCache) and local.root == tmp_path / "b"
    assert isinstance(open_cache(remote[0]), RemoteArtifactCache)
    with pytest.raises(BuildError, match="--cache nosuchproto://x: cannot read it"):
        open_cache("nosuchproto://x")


def test_local_readonly_cache_writes_nothing(tmp_path):
    writable = ArtifactCache(tmp_path / "c")
    writable.store(KEY, _artifact(tmp_path))
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "c").rglob("*"))
    ro = ArtifactCache(tmp_path / "c", readonly=True)
    assert ro.lookup(KEY) is not None
    other = CacheKey({"graph": "other"})
    artifact = _artifact(tmp_path, b"x", "o.pt2")
    assert ro.store(other, artifact) == artifact and ro.lookup(other) is None
    ro.store_trace(other, {"trace": 1})
    ro.remember("m/g", other)
    # a corrupt entry is a miss, and a read-only cache leaves it for its owner
    stored = writable.lookup(KEY)
    assert stored is not None
    stored.write_bytes(b"damaged")
    assert ro.lookup(KEY) is None and stored.exists()
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "c").rglob("*")) == before
    # a read-only cache that does not exist is empty, and is not created
    assert ArtifactCache(tmp_path / "none", readonly=True).lookup(KEY) is None
    assert not (tmp_path / "none").exists()


def test_remote_store_publishes_key_json_last_and_lookup_checks_the_object(tmp_path, remote):
    url, mirror = remote
    cache = RemoteArtifactCache(url, mirror=mirror)
    artifact = _artifact(tmp_path)
    cache.store(KEY, artifact, {"artifact_metadata": {"k": 1}})
    files = _files(url)
    entry = f"/entries/{KEY.digest}"
    meta = json.loads(files[f"{entry}/{KEY_JSON}"])
    assert meta["artifact"] == "g.pt2" and files[f"{entry}/{meta['object']}"] == b"compiled graph"
    got = cache.lookup(KEY)
    assert got is not None and got.read_bytes() == b"compiled graph" and got.name == "g.pt2"
    # what a hit restores (build.restore_unit) sits beside the local copy
    assert json.loads((got.parent / KEY_JSON).read_text())["artifact_metadata"] == {"k": 1}
    assert mirror in got.parents
    # a second lookup uses the mirror while the remote entry names the same bytes
    fs, base = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{base}{entry}/{meta['object']}")
    assert cache.lookup(KEY) == got


def test_remote_half_written_entries_are_misses(tmp_path, remote):
    """What an interrupted upload leaves on an object store is never used."""
    url, mirror = remote
    fs, base = fsspec.core.url_to_fs(url)
    cache = RemoteArtifactCache(url, mirror=mirror)
    cache.store(KEY, _artifact(tmp_path))
    entry = f"{base}/entries/{KEY.digest}"
    meta = json.loads(fs.cat_file(f"{entry}/{KEY_JSON}"))
    obj = f"{entry}/{meta['object']}"
    # 1. the object uploaded, key.json never written: no entry
    fs.rm_file(f"{entry}/{KEY_JSON}")
    assert cache.lookup(KEY) is None
    # 2. key.json written but its object short (a store without atomic PUT): a miss
    fs.pipe_file(f"{entry}/{KEY_JSON}", json.dumps(meta).encode())
    fs.pipe_file(obj, b"compiled")
    assert RemoteArtifactCache(url, mirror=tmp_path / "m2").lookup(KEY) is None
    # 3. key.json names an object that is not there: a miss
    fs.rm_file(obj)
    assert RemoteArtifactCache(url, mirror=tmp_path / "m3").lookup(KEY) is None
    # 4. unreadable key.json: a miss
    fs.pipe_file(f"{entry}/{KEY_JSON}", b"{not json")
    assert cache.lookup(KEY) is None
    # the next store publishes a whole entry again
    cache.store(KEY, _artifact(tmp_path))
    assert RemoteArtifactCache(url, mirror=tmp_path / "m4").lookup(KEY) is not None


def test_remote_racing_writers_leave_a_consistent_entry(tmp_path, remote):
    """Two compiles of one key (different bytes, as two AOTInductor runs give) both publish:
    key.json names one complete object, and a lookup returns exactly those bytes."""
    url, mirror = remote
    a = RemoteArtifactCache(url, mirror=tmp_path / "ma")
    b = RemoteArtifactCache(url, mirror=tmp_path / "mb")
    a.store(KEY, _artifact(tmp_path, b"compile one"))
    b.store(KEY, _artifact(tmp_path, b"compile two"))
    got = RemoteArtifactCache(url, mirror=mirror).lookup(KEY)
    assert got is not None and got.read_bytes() == b"compile two"
    # a mirror holding the other compile is replaced by what key.json names now
    stale = a.mirror.store(KEY, _artifact(tmp_path, b"compile one"))
    assert a.lookup(KEY) is not None and a.lookup(KEY).read_bytes() == b"compile two"
    assert not stale.exists() or stale.read_bytes() == b"compile two"


def test_remote_traces_and_labels(tmp_path, remote):
    url, mirror = remote
    fs, base = fsspec.core.url_to_fs(url)
    cache = RemoteArtifactCache(url, mirror=mirror)
    assert cache.lookup_trace(KEY) is None and cache.previous_factors("m/g") is None
    text = "%0 = output() : \n"
    traced = TraceResult(hashlib.sha256(text.encode()).hexdigest(), text, (), (), (), ("",), 1.0)
    cache.store_trace(KEY, traced)
    cache.remember("m/g", KEY)
    assert cache.lookup_trace(KEY) == traced
    assert cache.previous_factors("m/g") == KEY.factors
    # a damaged trace object (truncated) is a miss, not an error
    path = f"{base}/traces/{KEY.digest}.json.zst"
    fs.pipe_file(path, fs.cat_file(path)[:-5])
    assert cache.lookup_trace(KEY) is None


def test_remote_readonly_writes_nothing(tmp_path, remote):
    url, mirror = remote
    RemoteArtifactCache(url, mirror=mirror).store(KEY, _artifact(tmp_path))
    before = _files(url)
    ro = RemoteArtifactCache(url, readonly=True, mirror=mirror)
    assert ro.lookup(KEY) is not None
    other = CacheKey({"graph": "other"})
    ro.store(other, _artifact(tmp_path, b"x", "o.pt2"))
    ro.store_trace(other, {"t": 1})
    ro.remember("m/g", other)
    assert _files(url) == before and ro.lookup(other) is None


def test_owned_temp_dirs_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    """What a SIGKILLed process left (`<prefix><pid>-*`, pid gone) goes when the next process
    makes its own; a live process's directory and unrelated names stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"neffkit-aoti-{dead.pid}-abc").mkdir()
    (tmp_path / f"neffkit-aoti-{os.getppid()}-abc").mkdir()
    (tmp_path / "neffkit-aoti-notapid").mkdir()
    mine = owned_temp_dir("neffkit-aoti-", tmp_path)
    assert mine.name.startswith(f"neffkit-aoti-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [mine.name, f"neffkit-aoti-{os.getppid()}-abc", "neffkit-aoti-notapid"]
    )
