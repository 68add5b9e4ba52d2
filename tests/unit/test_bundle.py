"""Bundle format: a directory that is no bundle is refused with the reason, no traceback."""

from __future__ import annotations

from tests.unit.refusals import refused


def test_not_a_bundle(tmp_path):
    refused(tmp_path, "no bundle.json")


def test_a_missing_path_is_said_to_be_missing(tmp_path):
    """inspect and run name a path that is not there as missing, not as 'not a directory'."""
    from tests.support.cli import run_cli

    refused(tmp_path / "nowhere", "nowhere: does not exist")
    proc = run_cli("inspect", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert "not a directory" not in proc.stderr
