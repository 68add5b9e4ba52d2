"""Plain helper modules the tests import (no fixtures: those live in tests/conftest.py, and in
tests/e2e/conftest.py for what only tests/e2e uses):

  models.py   the tiny random HF checkpoints (MODELS: the oracle's configs), the shared prompts,
              test manifests (write_manifest)
  cache.py    the persistent, content-addressed test cache (docs/testing.md): cached_dir,
              artifact_cache, the compile environment's digest
  cli.py      the real CLI (run_cli in a subprocess, run_json, run_ids), bundle_json
  bundles.py  bundles built through the test cache (build_session_bundle, lowered_build), the
              bundles `make test` builds and the prebuild's registry (prebuild)
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
