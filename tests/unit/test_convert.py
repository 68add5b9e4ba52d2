"""`neffkit convert`'s user errors: named, exit 2, no traceback, nothing written."""

from __future__ import annotations

from tests.support.cli import run_cli


def test_a_missing_gguf_file_is_named(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("convert", str(tmp_path / "none.gguf"), "-o", str(out))
    assert proc.returncode == 2 and "none.gguf: no such GGUF file" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_file_that_is_not_gguf_is_refused_and_nothing_is_written(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file" * 10)
    out = tmp_path / "out"
    proc = run_cli("convert", str(bad), "-o", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "model.gguf" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]


def test_an_unknown_dtype_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"x")
    proc = run_cli("convert", str(bad), "-o", str(tmp_path / "out"), "--dtype", "int4")
    assert proc.returncode == 2 and "--dtype" in proc.stderr and "int4" in proc.stderr
