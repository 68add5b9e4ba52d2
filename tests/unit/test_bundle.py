"""Bundle format: a directory that is no bundle is refused with the reason, no traceback."""

from __future__ import annotations

from tests.unit.refusals import refused


def test_not_a_bundle(tmp_path):
    refused(tmp_path, "no bundle.json")
