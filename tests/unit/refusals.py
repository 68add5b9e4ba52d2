"""How a test checks that `neffkit run` refuses a bundle: exit 2, the reasons, no traceback."""

from __future__ import annotations

from tests.support.cli import run_cli


def refused(path, *needles):
    proc = run_cli("run", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    return proc.stderr
