"""No artifact can run code or write outside its place: packs, bundle.json and cache entries
written by someone else (docs/builds.md#what-must-be-trusted). Small hand-made bundles, packs and
cache entries; no build."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import pickle
import re
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import zstandard

from neffkit.compile.cache.local import KEY_JSON, ArtifactCache
from neffkit.compile.cache.remote import RemoteArtifactCache
from neffkit.compile.cache.traces import encode_trace
from neffkit.compile.units import CacheKey, LoweredGraph, TraceResult
from neffkit.contract.bundle import BUNDLE_JSON, read_bundle_dir, write_bundle_json
from neffkit.contract.pack import PackLimits, pack_bundle
from neffkit.contract.read import read_bundle
from neffkit.contract.records import BundleRecord, IoAlias, TensorRecord
from neffkit.errors import BundleError

KEY = CacheKey({"graph": "g", "flags": ["-O2"]})
GRAPH = {
    "name": "decode_b1_c8",
    "phase": "decode",
    "buckets": {"rows": 1, "tokens": 1, "context": 8},
    "artifact": "graphs/decode_b1_c8.pt2",
    "ir": "ir/decode_b1_c8.txt.zst",
    "graph_sha256": "0" * 64,
    "cache_key": None,
    "options": {},
    "option_origins": {},
    "flags": [],
    "flag_origins": {},
    "io_alias": [],
    "inputs": [],
    "outputs": [],
    "ranks": "all",
}
LAYOUT = {
    "world_size": 1,
    "tp": 1,
    "ep": 1,
    "dtype": "float32",
    "num_layers": 1,
    "kv_heads_per_rank": 1,
    "rank_input": False,
    "head_dim": 4,
    "block_size": 4,
    "num_blocks": 4,
    "buckets": {"prefill": [8], "decode": [1], "context": [8]},
    "max_top_k": 4,
    "kv_dtype": "float32",
}


def bundle_json(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "format": 1,
        "versions": {"neffkit": "0.1.0", "torch": "2", "backend": "test"},
        "target": "cpu",
        "host": {},
        "manifest": {"name": "tiny", "model": "/models/tiny", "resolved": {}},
        "model": {
            "architecture": "LlamaForCausalLM",
            "num_layers": 1,
            "vocab_size": 8,
            "eos_token_ids": [0],
            "config": {},
        },
        "layout": copy.deepcopy(LAYOUT),
        "graphs": [dict(GRAPH)],
        "weights": [{"rank": 0, "file": "weights/rank0.safetensors", "names": []}],
        "tokenizer": "tokenizer",
        "audit": {},
        "kernels": [],
    }
    data.update(changes)
    return data


def make_bundle(root: Path, graph: bytes = b"genuine compiled graph") -> Path:
    """A small bundle directory: a graph, its ir, a weight shard, a tokenizer file."""
    contents = {
        "graphs/decode_b1_c8.pt2": graph,
        "ir/decode_b1_c8.txt.zst": b"ir",
        "weights/rank0.safetensors": b"weights",
        "tokenizer/tokenizer.json": b"{}",
    }
    for rel, data in contents.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    write_bundle_json(root, BundleRecord.from_json(bundle_json()))
    return root


def write_pack(path: Path, members: list[tuple[str, int, io.RawIOBase | io.BytesIO]]) -> Path:
    """A pack with exactly these members (name, declared size, contents), in this order."""
    with path.open("wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as zw:
        with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name, size, data in members:
                info = tarfile.TarInfo(name)
                info.size = size
                tar.addfile(info, data)
    return path


def files_of(root: Path) -> list[tuple[str, int, io.BytesIO]]:
    rels = [BUNDLE_JSON, *sorted(read_bundle_dir(root, verify=False).record.files)]
    return [(r, (root / r).stat().st_size, io.BytesIO((root / r).read_bytes())) for r in rels]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "bundles"
    monkeypatch.setenv("NEFFKIT_BUNDLES", str(path))
    return path


# ------------------------------------------------------------------------------------ packs


def test_a_poisoned_pack_is_refused_and_cannot_shadow_the_genuine_one(tmp_path, cache):
    """A pack whose second `bundle.json` member overwrote the first used to be extracted under
    the genuine bundle's digest, and the genuine pack then served the poisoned files."""
    genuine_dir = make_bundle(tmp_path / "genuine")
    genuine = pack_bundle(genuine_dir)
    evil_dir = make_bundle(tmp_path / "evil", graph=b"evil compiled graph")
    members = files_of(evil_dir)
    poisoned = write_pack(
        tmp_path / "poisoned.tar.zst",
        [files_of(genuine_dir)[0], *members],  # the genuine bundle.json, then the evil one
    )
    with pytest.raises(BundleError, match="member 'bundle.json' appears twice"):
        read_bundle(poisoned)
    assert list(cache.iterdir()) == []
    bundle = read_bundle(genuine)
    assert bundle.path("graphs/decode_b1_c8.pt2").read_bytes() == b"genuine compiled graph"
    assert (
        bundle.root.name
        == bundle.digest
        == hashlib.sha256((genuine_dir / BUNDLE_JSON).read_bytes()).hexdigest()
    )


def test_a_poisoned_extraction_left_in_the_cache_is_replaced(tmp_path, cache):
    """What an older neffkit extracted from a poisoned pack (the genuine digest as its name, the
    evil bundle.json inside, consistent with its files) is not reused: it is extracted again."""
    genuine_dir = make_bundle(tmp_path / "genuine")
    genuine = pack_bundle(genuine_dir)
    digest = hashlib.sha256((genuine_dir / BUNDLE_JSON).read_bytes()).hexdigest()
    cache.mkdir()
    make_bundle(cache / digest, graph=b"evil compiled graph")
    read_bundle_dir(cache / digest)  # consistent in itself: hashes alone cannot tell
    for verify in (False, True):
        bundle = read_bundle(genuine, verify=verify)
        assert bundle.path("graphs/decode_b1_c8.pt2").read_bytes() == b"genuine compiled graph"
        assert bundle.digest == digest
    assert [p.name for p in cache.iterdir()] == [digest]


class Zeros(io.RawIOBase):
    """`size` zero bytes, made as they are read (a bomb costs no memory or disk to make)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


def zeros_sha256(size: int) -> str:
    digest, chunk = hashlib.sha256(), bytes(1 << 20)
    for _ in range(size >> 20):
        digest.update(chunk)
    return digest.hexdigest()


def test_a_zstd_bomb_is_refused_before_it_is_written(tmp_path, cache):
    """A pack of a few KB that declares 64 MiB (of zeros, its hash right): past `max_bytes` it
    is refused before a byte is written, and past `max_ratio` as soon as the stream expands too
    far; the default limits stay far above real bundles."""
    size = 64 << 20
    data = bundle_json(graphs=[], tokenizer=None)
    data["files"] = {"weights/rank0.safetensors": zeros_sha256(size)}
    meta = json.dumps(data).encode()
    bomb = write_pack(
        tmp_path / "bomb.tar.zst",
        [
            (BUNDLE_JSON, len(meta), io.BytesIO(meta)),
            ("weights/rank0.safetensors", size, Zeros(size)),
        ],
    )
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(BundleError, match=r"declare more than 8,388,608 bytes"):
        read_bundle(bomb, limits=PackLimits(max_bytes=8 << 20))
    assert list(cache.iterdir()) == []
    with pytest.raises(BundleError, match="expands more than 1,000 times"):
        read_bundle(bomb, limits=PackLimits(ratio_after=1 << 20))  # default: after 256 MiB
    with pytest.raises(BundleError, match="does not fit in the bundle cache"):
        read_bundle(bomb, limits=PackLimits(min_free_bytes=1 << 62))
    genuine = pack_bundle(make_bundle(tmp_path / "genuine"))
    with pytest.raises(BundleError, match="more than 2 files"):
        read_bundle(genuine, limits=PackLimits(max_files=2))
    with pytest.raises(BundleError, match="declares .* bytes, over the 100 a bundle.json"):
        read_bundle(genuine, limits=PackLimits(max_meta_bytes=100))
    assert list(cache.iterdir()) == []
    assert read_bundle(genuine).path("weights/rank0.safetensors").read_bytes() == b"weights"


def test_an_oversized_tar_header_is_refused_before_it_is_read(tmp_path, cache):
    """tar reads a pax header whole into memory: one declaring 64 MiB stops at the limit."""
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, 64 << 20
    pack = tmp_path / "header.tar.zst"
    with pack.open("wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as zw:
        zw.write(header.tobuf(format=tarfile.USTAR_FORMAT))
        for _ in range(64):
            zw.write(bytes(1 << 20))
    with pytest.raises(BundleError, match="runs past what its members declare"):
        read_bundle(pack, limits=PackLimits(max_meta_bytes=1 << 20))
    assert list(cache.iterdir()) == []


def test_pack_members_are_each_listed_once_and_hashed(tmp_path, cache):
    root = make_bundle(tmp_path / "b")
    dup = write_pack(tmp_path / "dup.tar.zst", [*files_of(root), files_of(root)[1]])
    with pytest.raises(BundleError, match=r"member 'graphs/decode_b1_c8.pt2' appears twice"):
        read_bundle(dup)
    extra = write_pack(tmp_path / "x.tar.zst", [*files_of(root), ("extra", 1, io.BytesIO(b"x"))])
    with pytest.raises(BundleError, match="files not in its bundle.json: extra"):
        read_bundle(extra)
    short = write_pack(tmp_path / "short.tar.zst", files_of(root)[:-1])
    with pytest.raises(BundleError, match="is missing"):
        read_bundle(short)
    wrong = [
        (n, s, io.BytesIO(b"W" * s) if n.startswith("weights") else d) for n, s, d in files_of(root)
    ]
    with pytest.raises(BundleError, match=r"file weights/rank0.safetensors is corrupt"):
        read_bundle(write_pack(tmp_path / "wrong.tar.zst", wrong))
    assert list(cache.iterdir()) == []


# ------------------------------------------------------------------------- bundle.json paths


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = data
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(last) if last.isdigit() else last] = value

    return change


def _add_file(rel: str, sha: str = "0" * 64) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["files"].__setitem__(rel, sha)


OUTSIDE_PATHS = [
    ("files", "/etc/hostname", _add_file("/etc/hostname")),
    ("files", "../outside.txt", _add_file("../outside.txt")),
    ("files", "bundle.json", _add_file("bundle.json")),
    ("graphs[0].artifact", "/tmp/x.pt2", _set("graphs.0.artifact", "/tmp/x.pt2")),
    ("graphs[0].ir", "ir/../../x", _set("graphs.0.ir", "ir/../../x")),
    ("graphs[0].hlo", "./x.pb", _set("graphs.0.hlo", "./x.pb")),
    ("weights[0].file", "weights//rank0", _set("weights.0.file", "weights//rank0")),
    ("tokenizer", "/etc", _set("tokenizer", "/etc")),
    ("kernels[0]", "..", _set("kernels", [".."])),
    (
        "layout.speculation.draft",
        "../d",
        _set(
            "layout.speculation",
            {"method": "draft", "num_tokens": 2, "max_batch": 1, "draft": "../d"},
        ),
    ),
]


@pytest.mark.parametrize(
    ("field", "value", "change"), OUTSIDE_PATHS, ids=[p[1] for p in OUTSIDE_PATHS]
)
def test_bundle_json_paths_stay_inside_the_bundle(tmp_path, cache, field, value, change):
    """A path outside the bundle is refused when the bundle is read (a directory or a pack),
    naming the field and the path; `inspect --verify` used to hash /etc/hostname."""
    root = make_bundle(tmp_path / "b")
    data = json.loads((root / BUNDLE_JSON).read_text())
    change(data)
    (root / BUNDLE_JSON).write_text(json.dumps(data))
    message = f"{field} '{value}' is not a path inside the bundle"
    for verify in (False, True):
        with pytest.raises(BundleError, match=re.escape(message)):
            read_bundle(root, verify=verify)
    meta = (root / BUNDLE_JSON).read_bytes()
    pack = write_pack(tmp_path / "p.tar.zst", [(BUNDLE_JSON, len(meta), io.BytesIO(meta))])
    with pytest.raises(BundleError, match=r"p\.tar\.zst/bundle\.json: "):
        read_bundle(pack)
    assert list(cache.iterdir()) == []


def test_an_absolute_path_with_the_right_hash_is_refused(tmp_path):
    """The reported case: a file outside the bundle, listed by absolute path with its hash."""
    outside = tmp_path / "outside.txt"
    outside.write_text("host secret")
    root = make_bundle(tmp_path / "b")
    data = json.loads((root / BUNDLE_JSON).read_text())
    data["files"][str(outside)] = hashlib.sha256(b"host secret").hexdigest()
    (root / BUNDLE_JSON).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=f"files '{outside}' is not a path inside the bundle"):
        read_bundle(root)


def test_a_file_linking_out_of_the_bundle_is_refused(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"weights")  # the very bytes bundle.json expects
    root = make_bundle(tmp_path / "b")
    (root / "weights/rank0.safetensors").unlink()
    (root / "weights/rank0.safetensors").symlink_to(outside)
    with pytest.raises(BundleError, match="file weights/rank0.safetensors links outside"):
        read_bundle(root)
    (root / "weights/rank0.safetensors").unlink()
    (root / "weights/real.bin").write_bytes(b"weights")
    (root / "weights/rank0.safetensors").symlink_to(root / "weights/real.bin")  # inside: fine
    read_bundle(root)


def test_files_values_must_be_hashes(tmp_path):
    root = make_bundle(tmp_path / "b")
    data = json.loads((root / BUNDLE_JSON).read_text())
    data["files"]["ir/decode_b1_c8.txt.zst"] = 5
    (root / BUNDLE_JSON).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"files\['ir/decode_b1_c8.txt.zst'\] is 5, not a sha256"):
        read_bundle(root, verify=False)


# --------------------------------------------------------------------------- cache entries


@pytest.fixture
def remote(tmp_path: Path) -> tuple[str, Path]:
    return f"memory://neffkit-hostile-{uuid.uuid4().hex}/cache", tmp_path / "mirror"


def _artifact(tmp_path: Path, data: bytes = b"compiled graph") -> Path:
    path = tmp_path / "made" / "g.pt2"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def trace(lowered: bool = True) -> TraceResult:
    text = "%0 = input input_ids : int64[1, 1]\n%1 = output(%0) : \n"
    proto = b"\x08\x01\x12\x00\xff"
    return TraceResult(
        graph_sha256=hashlib.sha256(text.encode()).hexdigest(),
        canonical_text=text,
        io_alias=(IoAlias("k_cache.0", 1),),
        inputs=(TensorRecord("input_ids", (1, 1), "int64"),),
        outputs=(TensorRecord("next_tokens", (1,), "int64"),),
        sources=("", "model.py:12: x = f(y)"),
        seconds=1.5,
        lowered=LoweredGraph(proto, "HloModule m", hashlib.sha256(proto).hexdigest())
        if lowered
        else None,
    )


class RunsCode:
    """What a cache writer would store: unpickling it touches `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _caches(tmp_path: Path, remote: tuple[str, Path]) -> list[Any]:
    return [ArtifactCache(tmp_path / "local"), RemoteArtifactCache(remote[0], mirror=remote[1])]


def _put(cache: Any, rel: str, data: bytes) -> None:
    if isinstance(cache, ArtifactCache):
        (cache.root / rel).write_bytes(data)
    else:
        cache.fs.pipe_file(f"{cache.base}/{rel}", data)


def test_trace_entries_are_data_and_never_unpickled(tmp_path, remote):
    """A pickle in a trace entry used to run on every builder reading the cache, read-only ones
    included; now entries are checked JSON, and a pickle (where the old format had it, or in the
    new one's place) is a miss that runs nothing."""
    url, mirror = remote
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsCode(marker))
    framed = hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload  # the old remote form
    local = ArtifactCache(tmp_path / "local")
    pairs = [
        (local, ArtifactCache(local.root, readonly=True), payload),
        (
            RemoteArtifactCache(url, mirror=mirror),
            RemoteArtifactCache(url, readonly=True, mirror=mirror),
            framed,
        ),
    ]
    for cache, ro, old in pairs:
        _put(cache, f"traces/{KEY.digest}.pkl", old)
        assert ro.lookup_trace(KEY) is None and cache.lookup_trace(KEY) is None
        for entry in (payload, zstandard.ZstdCompressor().compress(payload)):
            _put(cache, f"traces/{KEY.digest}.json.zst", entry)
            assert ro.lookup_trace(KEY) is None
        assert not marker.exists()
        for t in (trace(), trace(lowered=False)):
            cache.store_trace(KEY, t)
            assert cache.lookup_trace(KEY) == t and ro.lookup_trace(KEY) == t


def test_a_trace_entry_must_match_its_own_digests(tmp_path, remote):
    for cache in _caches(tmp_path, remote):
        good = trace()
        for bad in (
            TraceResult(**{**vars(good), "canonical_text": good.canonical_text + "%2 = x\n"}),
            TraceResult(
                **{**vars(good), "lowered": LoweredGraph(b"other", "", good.lowered.sha256)}
            ),
        ):
            _put(cache, f"traces/{KEY.digest}.json.zst", encode_trace(bad))
            assert cache.lookup_trace(KEY) is None
        entry = json.loads(zstandard.decompress(encode_trace(good)))
        entry["trace"]["inputs"][0]["shape"] = ["1", 1]  # strict: no coercion
        _put(cache, f"traces/{KEY.digest}.json.zst", zstandard.compress(json.dumps(entry).encode()))
        assert cache.lookup_trace(KEY) is None


def test_a_remote_key_json_cannot_write_outside_the_entry(tmp_path, remote):
    """key.json's artifact name was joined to the download directory: an absolute or `../` name
    wrote the object anywhere, and it stayed there after its hash check failed."""
    url, mirror = remote
    cache = RemoteArtifactCache(url, mirror=mirror)
    cache.store(KEY, _artifact(tmp_path))
    fs, base = fsspec.core.url_to_fs(url)
    entry = f"{base}/entries/{KEY.digest}"
    meta = json.loads(fs.cat_file(f"{entry}/{KEY_JSON}"))
    (tmp_path / "outside").mkdir()
    absolute = tmp_path / "outside" / "pwned"
    climbing = "../../../escaped"  # from mirrorN/tmp/<dir>/ up to tmp_path/escaped
    cases = [(str(absolute), meta["object"]), (climbing, meta["object"]), ("g.pt2", "../x")]
    for i, (name, obj) in enumerate(cases):
        for sha in (meta["artifact_sha256"], "0" * 64):
            bad = {**meta, "artifact": name, "object": obj, "artifact_sha256": sha}
            fs.pipe_file(f"{entry}/{KEY_JSON}", json.dumps(bad).encode())
            mirror_dir = tmp_path / f"mirror{i}{sha[0]}"
            assert RemoteArtifactCache(url, mirror=mirror_dir).lookup(KEY) is None
            assert list((mirror_dir / "tmp").iterdir()) == []  # nothing fetched is left
            assert not absolute.exists() and not (tmp_path / "escaped").exists()
    fs.pipe_file(f"{entry}/{KEY_JSON}", json.dumps(meta).encode())
    got = RemoteArtifactCache(url, mirror=tmp_path / "good").lookup(KEY)
    assert got is not None and got.read_bytes() == b"compiled graph"


def test_a_local_key_json_cannot_name_a_file_outside_the_entry(tmp_path):
    """An absolute artifact name with the right hash used to be a hit on that outside file."""
    outside = tmp_path / "outside.so"
    outside.write_bytes(b"outside")
    cache = ArtifactCache(tmp_path / "c")
    stored = cache.store(KEY, _artifact(tmp_path))
    meta_path = stored.parent / KEY_JSON
    meta = json.loads(meta_path.read_text())
    sha = hashlib.sha256(b"outside").hexdigest()
    for name in (str(outside), "../../../outside.so"):
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps({**meta, "artifact": name, "artifact_sha256": sha}))
        assert ArtifactCache(tmp_path / "c", readonly=True).lookup(KEY) is None
    # a link inside the entry to a file outside it, with that file's hash: not a hit either
    meta_path.write_text(json.dumps({**meta, "artifact_sha256": sha}))
    stored.unlink()
    stored.symlink_to(outside)
    assert ArtifactCache(tmp_path / "c", readonly=True).lookup(KEY) is None
    assert cache.lookup(KEY) is None and not stored.parent.exists() and outside.exists()
