"""`neffkit build` and `neffkit compile`: thin, they resolve arguments and call the build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from neffkit.cli.app import cli, console

if TYPE_CHECKING:
    from neffkit.compile.report import BuildResult


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Bundle directory.")
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    help="Worker processes (default: the CPUs this process may use).",
)
@click.option(
    "--cache",
    "cache_location",
    metavar="DIR|URL",
    help="Artifact cache: a directory or an fsspec URL such as s3://bucket/prefix "
    "(default: $NEFFKIT_CACHE or ~/.cache/neffkit).",
)
@click.option(
    "--no-cache", is_flag=True, help="Compile everything; read and write no artifact cache."
)
@click.option(
    "--cache-readonly",
    is_flag=True,
    help="Use the cache's entries but write nothing to it (serving hosts, untrusted CI).",
)
@click.option("--dry-run", is_flag=True, help="Trace and print the graph table; write nothing.")
@click.option(
    "--lower-only",
    is_flag=True,
    help="neuron: write a lowered bundle (HLO + weights) for `neffkit compile` on a Neuron host.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Run every graph against the eager model; record and check the result.",
)
@click.option(
    "--shard",
    metavar="K/N",
    help="CI matrix job K of N: trace and compile only this share into the cache; no bundle. "
    "A build without --shard then assembles the bundle from the cache.",
)
@click.option(
    "--pack",
    is_flag=True,
    help="Also write the bundle as one file, BUNDLE.tar.zst (run and inspect accept it).",
)
@click.option(
    "--cluster",
    metavar="ADDRESS",
    help="Run trace and compile jobs as Ray tasks on this cluster (auto, HOST:PORT or "
    "ray://HOST:PORT; pip install 'neffkit[cluster]'). Default: local processes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable build report.")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="A line per finished graph above the progress bars (a terminal prints none).",
)
def build(
    manifest: Path,
    output: Path | None,
    jobs: int | None,
    cache_location: str | None,
    no_cache: bool,
    cache_readonly: bool,
    dry_run: bool,
    lower_only: bool,
    verify: bool,
    shard: str | None,
    pack: bool,
    cluster: str | None,
    as_json: bool,
    verbose: bool,
) -> None:
    """Build MANIFEST into a bundle; prints the bundle path (and the pack's, with --pack)."""
    from neffkit.manifest import load_manifest

    resolved = load_manifest(manifest)  # validate before importing torch: bad input fails fast
    from neffkit.compile.build import build as run_build
    from neffkit.compile.cache import default_cache_dir
    from neffkit.compile.progress import Progress

    cache = None if no_cache else (cache_location or default_cache_dir())
    share = _parse_shard(shard) if shard else None
    progress = Progress(enabled=not as_json, verbose=verbose)
    try:
        result = run_build(
            resolved,
            output,
            jobs,
            progress,
            cache,
            dry_run,
            lower_only=lower_only,
            verify=verify,
            shard=share,
            cache_readonly=cache_readonly,
            cluster=cluster,
        )
    finally:
        progress.close()
    packed = None
    if pack and result.bundle is not None:  # dry runs and --shard builds write no bundle
        from neffkit.contract.pack import pack_bundle

        packed = pack_bundle(result.bundle)
    _report(result, packed, as_json, dry_run)


def _report(result: BuildResult, packed: Path | None, as_json: bool, dry_run: bool) -> None:
    """The build report as JSON, the plan table (dry run), or one line and the bundle path."""
    if as_json:
        report = result.report()
        if packed is not None:
            report["pack"] = str(packed)
        click.echo(json.dumps(report, indent=2))
    elif dry_run:
        _print_plan(result.graphs)
    else:
        c = result.counters
        click.echo(
            f"{c['graphs']} graphs: {c['traced']} traced ({c['trace_hits']} from the cache), "
            f"{c['compiled']} compiled ({c['cache_hits']} from the cache)",
            err=True,
        )
        if result.bundle is not None:
            click.echo(str(result.bundle))
        if packed is not None:
            click.echo(str(packed))


def _parse_shard(value: str) -> tuple[int, int]:
    """`K/N` with 1 <= K <= N."""
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise click.BadParameter(f"{value!r}: expected K/N with 1 <= K <= N, e.g. 2/4")
    return int(k), int(n)


@cli.command(name="compile")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Default: in place.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Parallel neuronx-cc processes.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report.")
def compile_bundle(bundle: Path, output: Path | None, jobs: int | None, as_json: bool) -> None:
    """Finish a lowered neuron BUNDLE with neuronx-cc (on a Neuron host)."""
    from neffkit.compile.backends.neuron.finish import finish_bundle
    from neffkit.compile.progress import Progress

    progress = Progress(enabled=not as_json)
    try:
        report = finish_bundle(bundle, output, jobs, progress)
    finally:
        progress.close()
    click.echo(json.dumps(report, indent=2) if as_json else report["bundle"])


def _print_plan(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="build plan (dry run: nothing written)")
    for col in ("graph", "phase", "rows", "tokens", "context", "options / flags", "cache"):
        table.add_column(col)
    for r in rows:
        b = r["buckets"]
        opts = " ".join([f"{k}={v}" for k, v in r["options"].items()] + r["flags"]) or "-"
        cache = r["cache"] + (f" ({r['miss_reason']})" if r.get("miss_reason") else "")
        table.add_row(
            r["name"], r["phase"], str(b["rows"]), str(b["tokens"]), str(b["context"]), opts, cache
        )
    console().print(table)
