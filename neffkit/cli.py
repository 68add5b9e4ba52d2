"""The `neffkit` command: build, run, inspect. Thin: resolve arguments, call one library function.

User errors (NeffkitError) print one message and a hint and exit 2, with no traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from neffkit import __version__
from neffkit.errors import NeffkitError
from neffkit.runtime.protocol import OFFLINE


def _fail(exc: NeffkitError) -> None:
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


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Worker processes (default: cores).")
@click.option(
    "--cache",
    "cache_location",
    metavar="DIR|URL",
    help="Artifact cache: a directory or an fsspec URL such as s3://bucket/prefix "
    "(default: $NEFFKIT_CACHE or ~/.cache/neffkit).",
)
@click.option("--no-cache", is_flag=True, help="Compile everything; read and write no cache.")
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
) -> None:
    """Build MANIFEST into a bundle; prints the bundle path (and the pack's, with --pack)."""
    from neffkit.manifest import load_manifest

    resolved = load_manifest(manifest)  # validate before importing torch: bad input fails fast
    from neffkit.compile.build import build as run_build
    from neffkit.compile.cache import default_cache_dir
    from neffkit.compile.progress import Progress

    cache = None if no_cache else (cache_location or default_cache_dir())
    share = _parse_shard(shard) if shard else None
    result = run_build(
        resolved,
        output,
        jobs,
        Progress(enabled=not as_json),
        cache,
        dry_run,
        lower_only=lower_only,
        verify=verify,
        shard=share,
        cache_readonly=cache_readonly,
        cluster=cluster,
    )
    packed = None
    if pack and not dry_run and share is None:
        from neffkit.bundle_pack import pack_bundle

        packed = pack_bundle(result.bundle)
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
    from neffkit.compile.finish import finish_bundle
    from neffkit.compile.progress import Progress

    report = finish_bundle(bundle, output, jobs, Progress(enabled=not as_json))
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
    _console().print(table)


def _console():
    from rich.console import Console

    # piped output (CI logs) gets a wide console instead of rich's 80-column default
    return Console(width=None if sys.stdout.isatty() else 160)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise NeffkitError(f"--prompt-ids: expected comma-separated ints, got {text!r}") from exc


@cli.command()
@click.argument("bundle", callback=lambda _ctx, _param, value: _local_bundle(value))
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Prompt token ids: 1,2,3.")
@click.option("--max-tokens", default=OFFLINE.max_tokens, type=int, show_default=True)
@click.option("--temperature", default=OFFLINE.temperature, type=float, show_default=True)
@click.option("--top-k", default=OFFLINE.top_k, type=int, show_default=True)
@click.option("--top-p", default=OFFLINE.top_p, type=float, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("--ignore-eos", is_flag=True, help="Generate max-tokens tokens regardless of EOS.")
@click.option("--json", "as_json", is_flag=True, help="Print outputs and timings as JSON.")
@click.option(
    "--dist-timeout",
    default=60.0,
    show_default=True,
    type=float,
    help="Seconds a rank waits for the others before failing (tp > 1).",
)
@click.option(
    "--executor",
    type=click.Choice(["auto", "aotinductor", "xla-cpu", "neuron"]),
    default="auto",
    show_default=True,
    help="How graphs run; xla-cpu runs a neuron bundle's HLO modules on this CPU.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Server: address to bind.")
@click.option("--port", default=8000, show_default=True, type=int, help="Server: port.")
@click.option(
    "--api-key",
    envvar="NEFFKIT_API_KEY",
    help="Server: require `Authorization: Bearer KEY` on /v1 (env NEFFKIT_API_KEY).",
)
@click.option(
    "--served-model-name", help="Server: the model id clients use (default: bundle name)."
)
@click.option(
    "--max-waiting",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Server: requests that may wait for KV blocks before new ones get 503.",
)
def run(
    bundle: Path,
    prompts: tuple[str, ...],
    prompt_ids: tuple[str, ...],
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    ignore_eos: bool,
    as_json: bool,
    dist_timeout: float,
    executor: str,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    max_waiting: int,
) -> None:
    """Generate from BUNDLE (with --prompt/--prompt-ids), or serve the OpenAI API (without)."""
    from neffkit.runtime.llm import GenerateRequest, run_offline
    from neffkit.runtime.protocol import SamplingParams

    if not prompts and not prompt_ids:  # no prompt: serve the OpenAI API
        from neffkit.runtime.api_server import serve

        status = serve(
            bundle,
            executor=executor,
            dist_timeout_s=dist_timeout,
            host=host,
            port=port,
            api_key=api_key,
            model_name=served_model_name,
            max_waiting=max_waiting,
        )
        sys.exit(status)

    request = GenerateRequest(
        texts=list(prompts),
        token_ids=[_parse_ids(p) for p in prompt_ids],
        params=SamplingParams(max_tokens, temperature, top_k, top_p, seed, (), ignore_eos),
    )
    report = run_offline(bundle, request, dist_timeout, executor)
    if report is None:  # a follower rank of a torchrun launch: rank 0 prints
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for out in report["outputs"]:
        click.echo(out["text"] if out["text"] is not None else ",".join(map(str, out["token_ids"])))


@cli.command()
@click.argument("target", callback=lambda _ctx, _param, value: _local_bundle(value))
@click.option("--graph", "graph_name", help="Show one graph: inputs, io-alias, flags, ops.")
@click.option(
    "--diff",
    "other",
    callback=lambda _ctx, _param, value: _local_bundle(value) if value else None,
    help="Compare with bundle B.",
)
@click.option("--verify", is_flag=True, help="Re-hash every file of the bundle.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (schema 1).")
def inspect(
    target: Path, graph_name: str | None, other: Path | None, verify: bool, as_json: bool
) -> None:
    """Audit a bundle (or a manifest, before building). Exit 1 on unwaived audit errors."""
    from neffkit import inspect as insp
    from neffkit.bundle import is_pack, read_bundle

    if target.is_file() and not is_pack(target):  # a manifest: no tracing
        report = insp.inspect_manifest(str(target))
        _emit(report, as_json, lambda r: insp.findings_table(r["findings"]))
        sys.exit(insp.exit_status(report))
    bundle = read_bundle(target, verify=verify)
    if other is not None:
        report = insp.diff_bundles(bundle, read_bundle(other, verify=verify))
        _emit(report, as_json, _render_diff)
        return
    if graph_name:
        report = insp.graph_detail(bundle, graph_name)
        _emit(report, as_json, _render_graph)
        sys.exit(insp.exit_status(report))
    report = insp.summarize(bundle)
    if verify:
        report["verified"] = True
    _emit(report, as_json, insp.render)
    sys.exit(insp.exit_status(report))


def _emit(report: dict, as_json: bool, render) -> None:
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _console().print(render(report))


def _render_graph(d: dict):
    from rich.console import Group
    from rich.table import Table

    from neffkit.inspect import findings_table

    io = Table(title=f"{d['name']} ({d['phase']}, ranks: {d['ranks']})")
    for col in ("input", "shape", "dtype", "aliased by output"):
        io.add_column(col)
    alias = {a["input"]: str(a["output"]) for a in d["io_alias"]}
    for i in d["inputs"]:
        io.add_row(i["name"], str(i["shape"]), i["dtype"], alias.get(i["name"], ""))
    for o in d["outputs"]:
        io.add_row(f"-> {o['name']}", str(o["shape"]), o["dtype"], "")
    flags = Table(title="options and flags")
    flags.add_column("option / flag")
    flags.add_column("origin")
    for k, v in d["options"].items():
        flags.add_row(f"{k}={v}", d["option_origins"].get(k, ""))
    for f in d["flags"]:
        flags.add_row(f["flag"], f["origin"])
    ops = Table(title="ops")
    ops.add_column("op")
    ops.add_column("count")
    for op, n in d["op_histogram"].items():
        ops.add_row(op, str(n))
    parts = [io, flags, ops]
    if d.get("hlo"):
        lines = [f"HLO module {d['hlo']} (sha256 {d['hlo_sha256'][:12]})"]
        pairs = d["hlo_input_output_alias"]
        lines.append(
            f"  input_output_alias: {len(pairs)} pair(s): "
            + ", ".join(f"out {a['output']} ← param {a['parameter']} ({a['input']})" for a in pairs)
        )
        if d.get("compiler"):
            lines.append(
                f"  compiled by {d['compiler']['version']}: {' '.join(d['compiler']['argv'])}"
            )
        header = d.get("neff_header")
        if header:
            lines.append(f"  NEFF header: {json.dumps(header)}")
        if d.get("verify"):
            lines.append(f"  verify: {json.dumps(d['verify'])}")
        parts.append("\n".join(lines))
    if d["collectives"]:
        parts.append("collectives:\n  " + "\n  ".join(d["collectives"]))
    if d["findings"]:
        parts.append(findings_table(d["findings"]))
    return Group(*parts)


def _render_diff(d: dict):
    lines = [f"a: {d['a']}", f"b: {d['b']}"]
    for key in ("graphs_added", "graphs_removed", "weights_changed"):
        if d[key]:
            lines.append(f"{key.replace('_', ' ')}: {', '.join(map(str, d[key]))}")
    for key in ("versions", "layout"):
        for k, (x, y) in d[key].items():
            lines.append(f"{key} {k}: {x} → {y}")
    for g in d["graphs_changed"]:
        parts = []
        if "graph_sha256" in g:
            parts.append(f"graph {g['graph_sha256'][0][:12]} → {g['graph_sha256'][1][:12]}")
        if "flags" in g:
            parts.append(f"flags -{g['flags']['removed']} +{g['flags']['added']}")
        if "options" in g:
            parts.append(f"options {g['options'][0]} → {g['options'][1]}")
        lines.append(f"{g['graph']}: " + "; ".join(parts))
    if len(lines) == 2:
        lines.append("no differences")
    return "\n".join(lines)


def _local_bundle(value: str) -> Path:
    """A bundle argument as a local path: a packed bundle at an fsspec URL (s3://…/B.tar.zst)
    is streamed once into the bundle cache, every file checked, and its directory returned."""
    if "://" not in value:
        return Path(value)
    from neffkit.bundle_pack import unpack_bundle

    return unpack_bundle(value)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except NeffkitError as exc:
        _fail(exc)
    except click.exceptions.Abort:  # click's form of KeyboardInterrupt (Ctrl-C, SIGTERM in builds)
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
