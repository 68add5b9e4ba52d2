"""`neffkit inspect`: audit a bundle (or a manifest, before building); exit 1 on unwaived audit
errors, so CI can gate on it."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from neffkit.cli.app import cli, console, local_bundle


@cli.command()
@click.argument("target", callback=lambda _ctx, _param, value: local_bundle(value))
@click.option("--graph", "graph_name", help="Show one graph: inputs, io-alias, flags, ops.")
@click.option(
    "--diff",
    "other",
    callback=lambda _ctx, _param, value: local_bundle(value) if value else None,
    help="Compare with bundle B.",
)
@click.option("--verify", is_flag=True, help="Re-hash every file of the bundle.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (schema 1).")
def inspect(
    target: Path, graph_name: str | None, other: Path | None, verify: bool, as_json: bool
) -> None:
    """Audit a bundle (or a manifest, before building). Exit 1 on unwaived audit errors."""
    from neffkit.contract.bundle import is_pack
    from neffkit.contract.read import read_bundle
    from neffkit.inspect import render
    from neffkit.inspect.bundle import (
        diff_bundles,
        exit_status,
        graph_detail,
        summarize,
        verification,
    )
    from neffkit.inspect.manifest import inspect_manifest

    if target.is_file() and not is_pack(target):  # a manifest: no tracing
        report = inspect_manifest(str(target))
        _emit(report, as_json, render.render_manifest)
        sys.exit(exit_status(report))
    bundles = [read_bundle(p, verify=verify) for p in (target, other) if p is not None]
    checks = [verification(b) for b in bundles] if verify else []
    if other is not None:
        report = diff_bundles(*bundles)
    elif graph_name:
        report = graph_detail(bundles[0], graph_name)
    else:
        report = summarize(bundles[0])
    if verify:
        report["verified"], report["verification"] = True, checks
    shown = render.render_diff if other else render.render_graph if graph_name else render.render
    _emit(report, as_json, shown)
    sys.exit(0 if other is not None else exit_status(report))


def _emit(report: dict, as_json: bool, render: Callable[[dict[str, Any]], Any]) -> None:
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    from neffkit.inspect.render import verification_lines

    console().print(render(report))
    if report.get("verification"):  # --verify: what was re-hashed, and that it matched
        click.echo(verification_lines(report["verification"]))
