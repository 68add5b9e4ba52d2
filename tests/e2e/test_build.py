"""Incremental, explainable, interruptible builds (content-addressed cache)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from neffkit.compile.cache.local import KEY_JSON, ArtifactCache
from neffkit.compile.units import CacheKey
from tests.support import REPO
from tests.support.cache import artifact_cache
from tests.support.cli import bundle_json
from tests.support.models import EXTRA, MODELS, write_manifest


def _build_cmd(manifest: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "neffkit",
        "build",
        str(manifest),
        "-o",
        str(out),
        "--cache",
        str(cache),
        *extra,
    ]


def _cli_build(manifest: Path, out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    # one worker, in the build's own process: no pool to start on a machine the tests share
    cmd = _build_cmd(manifest, out, cache, *extra, *(() if "-j" in extra else ("-j", "1")))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)


def test_rebuild_compiles_nothing_and_is_byte_identical(bundle, session_dir, tmp_path):
    first = bundle("llama_tied")
    manifest = session_dir / "llama_tied.yaml"
    proc = _cli_build(manifest, tmp_path / "again", artifact_cache(), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # the early key (DESIGN.md "Cache"): nothing changed, so nothing is traced either
    assert report["counters"] == {
        "graphs": 3,
        "traced": 0,
        "trace_hits": 3,
        "spmd_groups": 0,
        "per_rank_graphs": 0,
        "compiled": 0,
        "cache_hits": 3,
        # the weight shard is not cut again: linked (or copied) from the cache
        next(k for k in report["counters"] if k.startswith("weights_")): 1,
    }
    assert "weights_cut" not in report["counters"]
    assert all(g["cache"] == "hit" for g in report["graphs"])
    assert set(report["seconds"]) >= {"plan", "trace", "compile", "write"}
    assert report["peak_rss_mb"]["main"] > 0
    second = Path(report["bundle"])
    assert (first / "bundle.json").read_bytes() == (second / "bundle.json").read_bytes()
    # the projection form each graph was written with (cpu: blocked weights; llama_tied's
    # rows through neffkit's kernel, cpu_kernel: on, prefill's tokens too; without it, decode
    # rows as Inductor's per-row reductions and prefill as bmm over the blocks)
    forms = {g["name"]: g["projection"] for g in bundle_json(second)["graphs"]}
    kernel = EXTRA["llama_tied"]["compiler"]["cpu_kernel"] == "on"
    decode = "kernel-rows" if kernel else "blocked-rows"
    assert forms == {
        "prefill_t16_c64": "kernel-rows" if kernel else "blocked-bmm",
        "decode_b1_c64": decode,
        "decode_b4_c64": decode,
    }
    assert (first / "kernels").exists() == kernel
    for ir in (first / "ir").iterdir():
        assert ir.read_bytes() == (second / "ir" / ir.name).read_bytes()


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An S3-compatible endpoint for this test: moto's server, started here and stopped here
    (no real object store is reachable from CI). Yields the environment a client needs."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "NEFFKIT_CACHE_MIRROR": str(tmp_path / "mirror"),
        "NEFFKIT_BUNDLES": str(tmp_path / "unpacked"),
    }
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "moto server did not start"
                time.sleep(0.2)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


def _s3fs(env: dict[str, str]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=env["AWS_ENDPOINT_URL"],
        use_listings_cache=False,
    )


@pytest.mark.full  # two graphs compiled into a fresh S3 cache, and one again: `make test-all`
def test_ci_shards_fill_one_s3_cache_and_the_assembly_compiles_nothing(
    bundle, session_dir, tmp_path, s3
):
    """`--shard 1/2` and `--shard 2/2` run as separate processes (a CI matrix) into one fresh
    cache on an S3 endpoint, each tracing and compiling only its share and writing no bundle;
    the build without a shard then traces and compiles nothing, and its bundle.json and ir/
    are byte-identical to a local build's (packages made reproducible: inductor's
    make_reproducible). Then: an entry whose upload stopped before its key.json is compiled
    again, `--cache-readonly` writes nothing, and the pack is read back from the bucket.
    qwen3's bundle: two graphs, one per share. (`make test` reads a pack from S3 below; the
    cache's store rules on an fsspec store are unit tests.)"""
    first = bundle("qwen3")
    manifest = session_dir / "qwen3.yaml"
    fs = _s3fs(s3)
    fs.mkdir("neffkit-ci")
    cache = "s3://neffkit-ci/cache"
    env = {**os.environ, **s3}

    def cli_build(out: Path | None, *extra: str) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "neffkit", "build", str(manifest), "--cache", cache]
        cmd += [*(["-o", str(out)] if out else []), *extra, "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "neffkit",
                "build",
                str(manifest),
                "--cache",
                cache,
                "--shard",
                f"{k}/2",
                "-j",
                "1",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for k in (1, 2)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        reports.append(json.loads(out))
    shares = [{g["name"] for g in r["graphs"]} for r in reports]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == {"prefill_t16_c64", "decode_b4_c64"}
    for r, share in zip(reports, shares, strict=True):
        assert r["bundle"] is None and r["counters"]["compiled"] == len(share)
        assert r["counters"]["traced"] == len(share)
    report = cli_build(tmp_path / "assembled", "--pack")
    assert report["counters"]["traced"] == 0 and report["counters"]["compiled"] == 0
    second = Path(report["bundle"])
    assert (first / "bundle.json").read_bytes() == (second / "bundle.json").read_bytes()
    for ir in (first / "ir").iterdir():
        assert ir.read_bytes() == (second / "ir" / ir.name).read_bytes()

    # an upload interrupted before its key.json: the object is there, the entry is not
    entries = {
        k.rsplit("/", 1)[0]: "artifact_metadata" in json.loads(fs.cat_file(k))
        for k in fs.find("neffkit-ci/cache/entries")
        if k.endswith(KEY_JSON)
    }
    graph_entries = [e for e, is_graph in entries.items() if is_graph]
    weight_entries = [e for e, is_graph in entries.items() if not is_graph]
    assert len(graph_entries) == 2 and len(weight_entries) == 1
    fs.rm_file(f"{graph_entries[0]}/{KEY_JSON}")
    again = cli_build(tmp_path / "again")
    assert again["counters"]["compiled"] == 1 and again["counters"]["traced"] == 0
    assert fs.exists(f"{graph_entries[0]}/{KEY_JSON}")  # published again
    # read-only: a weight shard and a trace missing from the cache are made again (the same
    # store and store_trace a compiled graph goes through) and nothing is written back
    fs.rm_file(f"{weight_entries[0]}/{KEY_JSON}")
    fs.rm_file(fs.find("neffkit-ci/cache/traces")[0])
    objects = {k: fs.info(k)["ETag"] for k in fs.find("neffkit-ci")}
    readonly = cli_build(tmp_path / "ro", "--cache-readonly")
    assert readonly["counters"]["traced"] == 1 and readonly["counters"]["compiled"] == 0
    assert readonly["counters"].get("weights_cut") == 1, readonly["counters"]
    assert {k: fs.info(k)["ETag"] for k in fs.find("neffkit-ci")} == objects  # nothing written
    bad = _cli_build(manifest, tmp_path / "x", tmp_path / "c", "--shard", "3/2")
    assert bad.returncode == 2 and "expected K/N with 1 <= K <= N" in bad.stderr

    _inspect_from_s3(fs, env, second, Path(report["pack"]))


def test_a_pack_on_s3_is_inspected_by_url(bundle, tmp_path, s3):
    """A bundle's pack uploaded to an S3 endpoint: `inspect --verify` by URL equals the
    directory's; a missing pack is named, without a traceback."""
    from neffkit.contract.pack import pack_bundle

    local = tmp_path / "qwen3"
    shutil.copytree(bundle("qwen3"), local)
    fs = _s3fs(s3)
    fs.mkdir("neffkit-ci")
    _inspect_from_s3(fs, {**os.environ, **s3}, local, pack_bundle(local))


def _inspect_from_s3(fs: Any, env: dict[str, str], bundle_dir: Path, pack: Path) -> None:
    # the pack, uploaded and read back by URL: inspect equals the directory's
    fs.put_file(str(pack), "neffkit-ci/bundles/qwen3.tar.zst")
    inspected = [
        subprocess.run(
            [sys.executable, "-m", "neffkit", "inspect", target, "--verify", "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
        )
        for target in (str(bundle_dir), "s3://neffkit-ci/bundles/qwen3.tar.zst")
    ]
    assert all(p.returncode == 0 for p in inspected), inspected[1].stderr
    from_dir, from_url = (json.loads(p.stdout) for p in inspected)
    for inspected_report in (from_dir, from_url):  # where each was read from differs
        inspected_report.pop("bundle", None)
        for verified in inspected_report.get("verification", []):
            verified.pop("bundle", None)
    assert from_dir == from_url
    missing = subprocess.run(
        [sys.executable, "-m", "neffkit", "inspect", "s3://neffkit-ci/bundles/none.tar.zst"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert missing.returncode == 2 and "none.tar.zst: no such pack" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.full  # six traces on every run: `make test-all`
def test_a_changed_checkpoint_is_traced_again(bundle, session_dir, hf_model_dir, tmp_path):
    """A checkpoint file's stamp is part of the early key: touching it retraces every graph;
    the traced graphs are unchanged, so nothing recompiles."""

    bundle("llama_tied")  # the cache holds this model's artifacts
    model = tmp_path / "model"
    shutil.copytree(hf_model_dir("llama_tied"), model)
    manifest = write_manifest(
        tmp_path / "m.yaml", model, buckets=MODELS["llama_tied"][2], **EXTRA["llama_tied"]
    )
    cache = artifact_cache()
    first = json.loads(_cli_build(manifest, tmp_path / "a", cache, "--json").stdout)
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    again = json.loads(_cli_build(manifest, tmp_path / "b", cache, "--json").stdout)
    for report in (first, again):
        assert report["counters"]["traced"] == 3 and report["counters"]["compiled"] == 0
    warm = json.loads(_cli_build(manifest, tmp_path / "c", cache, "--json").stdout)
    assert warm["counters"]["traced"] == 0 and warm["counters"]["compiled"] == 0


def _evict(cache: Path, options: dict[str, Any]) -> None:
    """Drop the cache's entries compiled with these options: a test that must see them
    compiled again (the test cache persists across runs) starts without them."""
    for key_json in (cache / "entries").glob(f"*/{KEY_JSON}"):
        factors = json.loads(key_json.read_text()).get("factors", {})
        if options.items() <= (factors.get("options") or {}).items():
            shutil.rmtree(key_json.parent, ignore_errors=True)


@pytest.mark.full  # a graph compiled again on every run: `make test-all`; `make test` checks the
# options a rule changes (tests/unit/test_flags.py) and rebuilds that compile nothing
def test_one_rule_change_recompiles_exactly_its_graphs(bundle, session_dir, hf_model_dir, tmp_path):
    bundle("llama_tied")  # the cache holds this manifest's graphs
    # the last build of this manifest is the unchanged one (the session's may come from the
    # test cache, and the cache's labels from an earlier run of this test)
    before = _cli_build(session_dir / "llama_tied.yaml", tmp_path / "before", artifact_cache())
    assert before.returncode == 0, before.stderr
    rule = {"match": {"phase": "decode", "batch": 4}, "inductor": {"epilogue_fusion": False}}
    _evict(artifact_cache(), rule["inductor"])
    extra = EXTRA["llama_tied"]  # the session bundle's fields, the rule added
    manifest = write_manifest(
        tmp_path / "llama_tied.yaml",
        hf_model_dir("llama_tied"),
        buckets=MODELS["llama_tied"][2],
        **{**extra, "compiler": {**extra["compiler"], "per_graph": [rule]}},
    )
    proc = _cli_build(manifest, tmp_path / "out", artifact_cache(), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["counters"]["compiled"] == 1
    rows = {g["name"]: g for g in report["graphs"]}
    assert rows["decode_b4_c64"]["cache"] == "miss"
    assert rows["decode_b1_c64"]["cache"] == rows["prefill_t16_c64"]["cache"] == "hit"
    assert (
        "decode_b4_c64: recompiling, options changed: epilogue_fusion=(unset) → False"
        in proc.stderr
    )
    graph = next(g for g in bundle_json(tmp_path / "out")["graphs"] if g["name"] == "decode_b4_c64")
    assert graph["options"] == {
        "aot_inductor.compile_wrapper_opt_level": "O0",
        "epilogue_fusion": False,
        "realize_opcount_threshold": 16,
    }
    assert graph["option_origins"] == {
        "aot_inductor.compile_wrapper_opt_level": "base",
        "epilogue_fusion": "rule 0",
        "realize_opcount_threshold": "base",
    }
    # inspect --diff names exactly that graph and that option
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neffkit",
            "inspect",
            str(bundle("llama_tied")),
            "--diff",
            str(tmp_path / "out"),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    diff = json.loads(proc.stdout)
    assert diff["graphs_changed"] == [
        {"graph": "decode_b4_c64", "options": [{}, {"epilogue_fusion": False}]}
    ]
    assert diff["graphs_added"] == diff["graphs_removed"] == diff["weights_changed"] == []
    assert diff["versions"] == {} and diff["layout"] == {}


def test_dry_run_writes_nothing(bundle, session_dir, tmp_path):
    bundle("llama_tied")
    out = tmp_path / "never"
    proc = _cli_build(session_dir / "llama_tied.yaml", out, artifact_cache(), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "decode_b4_c64" in proc.stdout and "hit" in proc.stdout
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _entries_valid(cache: Path) -> int:
    entries = list((cache / "entries").iterdir()) if (cache / "entries").exists() else []
    for entry in entries:
        meta = json.loads((entry / KEY_JSON).read_text())
        assert (entry / meta["artifact"]).exists()
    ArtifactCache(cache)  # opening it validates nothing away
    for entry in entries:
        key = CacheKey(json.loads((entry / KEY_JSON).read_text())["factors"])
        assert ArtifactCache(cache).lookup(key) is not None, entry
    return len(entries)


def _kill_mid_compile(sig: int, manifest: Path, out: Path, cache: Path, tmp_path: Path) -> str:
    """Start a build, send `sig` to its process group once g++ runs; return its log."""
    log = tmp_path / f"log-{sig}.txt"
    # SIGINT handled as Python does by default, whatever the test process inherited: a
    # process started while SIGINT is ignored keeps ignoring it (here: after the Ray cluster
    # test ran in the same worker), and the build would run to the end
    restore = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'neffkit'; runpy.run_module('neffkit', run_name='__main__')"
    )
    cmd = [sys.executable, "-c", restore, *_build_cmd(manifest, out, cache, "-j", "2")[3:]]
    # Inductor's own cache in a directory of this test's: a graph another test (or the other
    # signal's run) compiled would otherwise come back in a second, before the signal lands
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{sig}")}
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True, env=env
        )
    deadline = time.time() + 300
    while "compile:" not in log.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert "compile:" in log.read_text(), log.read_text()
    time.sleep(3)  # g++ is running now
    os.killpg(proc.pid, sig)
    assert proc.wait(timeout=60) != 0
    return log.read_text()


@pytest.mark.full  # two killed builds and a whole one on every run: `make test-all`
def test_killed_builds_leave_nothing_half_written(hf_model_dir, tmp_path):
    """A build interrupted (SIGINT) or killed (SIGKILL) while it compiles leaves no bundle and no
    half-written cache entry; the next build succeeds and clears what the SIGKILL left behind."""
    cache = tmp_path / "cache"
    manifest = write_manifest(
        tmp_path / "kill.yaml",
        hf_model_dir("llama_tied"),
        buckets={"prefill": [32], "decode": [2], "context": [64]},
    )
    out = tmp_path / "bundles" / "kill"
    for sig in (signal.SIGINT, signal.SIGKILL):
        text = _kill_mid_compile(sig, manifest, out, cache, tmp_path)
        assert not out.exists()
        if sig == signal.SIGINT:
            assert "interrupted: nothing was written" in text and "Traceback" not in text
            assert "leaked" not in text
            assert [p.name for p in out.parent.iterdir()] == []  # staging dir removed
            assert not list((cache / "tmp").iterdir())
        _entries_valid(cache)
    # the next build succeeds and clears what a SIGKILL left behind
    again = _cli_build(manifest, out, cache, "--json")
    assert again.returncode == 0, again.stderr
    assert [p.name for p in out.parent.iterdir()] == ["kill"]
    assert not list((cache / "tmp").iterdir())
    assert _entries_valid(cache) == 3  # two graphs and the weight shard


def test_cache_entry_corruption_is_a_miss(tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    artifact = tmp_path / "a.pt2"
    artifact.write_bytes(b"compiled")
    key = CacheKey({"graph": "x", "flags": ["-O2"]})
    stored = cache.store(key, artifact)
    assert cache.lookup(key) == stored
    stored.write_bytes(b"damaged")
    assert cache.lookup(key) is None and not stored.parent.exists()
    # storing the same key twice (two builds racing) keeps one valid entry
    cache.store(key, artifact)
    cache.store(key, artifact)
    assert cache.lookup(key) is not None
    assert list((tmp_path / "c" / "tmp").iterdir()) == []


def test_a_hub_id_builds_from_the_cache_and_records_its_commit(hf_model_dir, tmp_path):
    """`model: org/tiny@v1` resolved offline through a Hugging Face cache: bundle.json and
    inspect name the commit; the same commit again compiles nothing."""
    sha = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v1").write_text(sha)
    shutil.copytree(hf_model_dir("llama"), repo / "snapshots" / sha)
    manifest = write_manifest(tmp_path / "hub.yaml", tmp_path, buckets=MODELS["llama"][2])
    manifest.write_text(manifest.read_text().replace(f"model: {tmp_path}", "model: org/tiny@v1"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    for out in ("first", "second"):  # the test cache: llama's graphs are there already
        cmd = [*_build_cmd(manifest, tmp_path / out, artifact_cache(), "--json"), "-j", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["counters"]["compiled"] == 0
    record = json.loads((tmp_path / "second" / "bundle.json").read_text())
    assert record["manifest"]["model_revision"] == sha
    assert record["manifest"]["model"] == str(repo / "snapshots" / sha)
    shown = subprocess.run(
        [sys.executable, "-m", "neffkit", "inspect", str(tmp_path / "second")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    ).stdout
    assert f"revision {sha}" in shown
