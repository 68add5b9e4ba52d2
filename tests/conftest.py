"""The suite's hooks and the fixtures tests/unit and tests/e2e share. Plain helpers live in
tests/support/ (checkpoints, the test cache, the CLI, bundles); fixtures only tests/e2e uses
(bundles, the prebuild, lowered bundles, the HF oracle's greedy generate) in tests/e2e/conftest.py.

Every checkpoint and build goes through one persistent, content-addressed test cache
(tests/support/cache.py, docs/testing.md), so nothing unchanged is made or compiled twice on
one machine. Tests under tests/e2e/ build bundles, start servers or run HF models (marked `e2e`
by where they are); tests/unit/ builds nothing; `full` tests run only in `make test-all`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from neffkit.platform import cpus
from tests.support import REPO as REPO  # re-exported: tests/unit/test_layering.py imports it
from tests.support import progress
from tests.support.cache import cache_root
from tests.support.models import DEMO_MODEL as DEMO_MODEL  # re-exported, as REPO is
from tests.support.models import make_missing_models, model_dir_name

E2E = REPO / "tests" / "e2e"


# tests that compile for real on every run (their caches start empty on purpose): scheduled
# first, so the two workers share them instead of one running them at the end
COMPILE_EVERY_RUN = (
    "test_ci_shards_fill_one_s3_cache_and_the_assembly_compiles_nothing",
    "test_killed_builds_leave_nothing_half_written",
    "test_one_rule_change_recompiles_exactly_its_graphs",
    "test_a_changed_checkpoint_is_traced_again",
    "test_build_pack_round_trips_through_run_and_inspect",
    "test_build_with_compiler_compiles_and_caches",
    "test_cluster_build_equals_local_and_survives_a_lost_node",
    "test_per_rank_artifacts_opt_in",
)


def pytest_configure(config: pytest.Config) -> None:
    """A build or run a test starts without naming a cache uses the test cache's, never the
    user's ~/.cache/neffkit (subprocesses inherit these).

    Under xdist, each worker's engines (in this process or a server it starts) take its share of
    the CPUs, as two engines on one host should: with every worker running as many OpenMP
    threads as there are cores, a decode step waits at each parallel region for a thread the
    other worker has preempted: the six speculation and MTP tests that each run 200 requests
    took 121 s of calls on two workers with two threads each, 20 s with one."""
    os.environ.setdefault("NEFFKIT_CACHE", str(cache_root() / "default-cache"))
    os.environ.setdefault("NEFFKIT_BUNDLES", str(cache_root() / "unpacked"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault(cpus.ENV, str(max(1, cpus.usable_cpus() // workers)))
        torch.set_num_threads(int(os.environ[cpus.ENV]))


_reporter: list[progress.Reporter] = []  # the controller's, while the session runs


def pytest_sessionstart(session: pytest.Session) -> None:
    """The controller says what the workers are making, and beats while nothing else prints
    (tests/support/progress.py)."""
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get("PYTEST_XDIST_WORKER") or terminal is None:
        return
    path = Path(tempfile.mkdtemp(prefix="neffkit-progress-")) / "progress.log"
    os.environ[progress.ENV] = str(path)  # workers start after this, and inherit it
    _reporter.append(progress.Reporter(path, terminal.write_line))
    _reporter[0].start()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _reporter and report.when == "call":
        _reporter[0].reported(report.passed)


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _reporter:
        reporter = _reporter.pop()
        reporter.stop()
        shutil.rmtree(reporter.path.parent, ignore_errors=True)
        os.environ.pop(progress.ENV, None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests under tests/e2e/ build bundles, start servers or run HF models: marked `e2e` by where
    they are. The tests that compile on every run go first (a stable sort keeps the rest in
    order)."""
    for item in items:
        if E2E in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in COMPILE_EVERY_RUN)


@pytest.fixture(scope="session")
def hf_model_dir() -> Callable[[str], Path]:
    """kind → its tiny random HF checkpoint (persistent: tests/support/cache.py)."""

    def get(kind: str) -> Path:
        out = cache_root() / model_dir_name(kind)
        if not (out / ".complete").exists():
            make_missing_models()
        return out

    return get
