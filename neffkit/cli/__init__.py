"""The `neffkit` command: build, compile, run, inspect. Thin: resolve arguments, call one library
function (the commands are app.py's group, one module each).

User errors (NeffkitError) print one message and a hint and exit 2, with no traceback.
"""

from __future__ import annotations

import sys

import click

from neffkit.cli import build, convert, inspect, run  # noqa: F401  (each registers its commands)
from neffkit.cli.app import cli, fail
from neffkit.errors import NeffkitError


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except NeffkitError as exc:
        fail(exc)
    except click.exceptions.Abort:  # click's form of KeyboardInterrupt (Ctrl-C, SIGTERM in builds)
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
