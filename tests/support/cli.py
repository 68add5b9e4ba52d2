"""The real CLI, as a user runs it, and bundle records read through the product's reader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO
from tests.support.models import MAX_NEW


def run_cli(
    *args: str, check: bool = False, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as a user runs it (in `env`, else this process's)."""
    proc = subprocess.run(
        [sys.executable, "-m", "neffkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"neffkit {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def run_json(*args: str) -> dict[str, Any]:
    """The CLI's --json output. `neffkit run` of a one-rank cpu bundle runs in this process
    (click's test runner: the same command, argument parsing to report, without starting a
    Python and torch); everything else, and every test of exit codes and messages, through a
    real subprocess (run_cli)."""
    if _runs_here(args):
        from click.testing import CliRunner

        from neffkit.cli import cli

        result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)
    return json.loads(run_cli(*args, "--json", check=True).stdout)


def _runs_here(args: tuple[str, ...]) -> bool:
    if len(args) < 2 or args[0] != "run" or "--executor" in args:
        return False
    meta = Path(args[1]) / "bundle.json"
    if not meta.is_file():
        return False
    record = json.loads(meta.read_text())
    return record["target"] == "cpu" and record["layout"]["world_size"] == 1


def run_ids(path: Path, prompts: list[list[int]], max_tokens: int = MAX_NEW, *extra: str):
    """`neffkit run` on token-id prompts: each prompt's generated ids, in prompt order."""
    args = ["run", str(path), "--max-tokens", str(max_tokens), *extra]
    for prompt in prompts:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    return [o["token_ids"] for o in run_json(*args)["outputs"]]


def bundle_json(path: Path) -> dict[str, Any]:
    """bundle.json of a bundle, opened (and every file verified) through the typed record."""
    from neffkit.contract.read import read_bundle

    return read_bundle(path).record.to_json()
