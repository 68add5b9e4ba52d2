"""The `neffkit` command group and how user errors leave it: one message, a hint, exit 2, no
traceback. The commands live beside it, one module per command (build.py, run.py, inspect.py).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from neffkit import __version__
from neffkit.errors import NeffkitError

if TYPE_CHECKING:
    from rich.console import Console


def fail(exc: NeffkitError) -> None:
    click.echo(f"error: {exc.message}", err=True)
    if exc.hint:
        click.echo(f"hint: {exc.hint}", err=True)
    sys.exit(2)


@click.group()
@click.version_option(__version__, prog_name="neffkit")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def cli(verbose: bool) -> None:
    """Build LLM inference graphs ahead of time; serve the bundle with no compiler."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")


def console() -> Console:
    """A rich console; piped output (CI logs) gets a wide one instead of rich's 80 columns."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def local_bundle(value: str) -> Path:
    """A bundle argument as a local path: a packed bundle at an fsspec URL (s3://…/B.tar.zst)
    is streamed once into the bundle cache, every file checked, and its directory returned."""
    if "://" not in value:
        return Path(value)
    from neffkit.contract.pack import unpack_bundle

    return unpack_bundle(value)
