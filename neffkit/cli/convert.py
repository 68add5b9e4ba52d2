"""`neffkit convert`: a GGUF file into an HF checkpoint directory a manifest can name."""

from __future__ import annotations

import json
from pathlib import Path

import click

from neffkit.cli.app import cli


@cli.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    help="The HF checkpoint directory to write.",
)
@click.option(
    "--dtype",
    default="float32",
    show_default=True,
    help="float32, bfloat16 or float16: the dequantized dtype.",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def convert(source: Path, out: Path, dtype: str, as_json: bool) -> None:
    """Convert the GGUF file SOURCE into an HF checkpoint directory (config, safetensors,
    tokenizer, chat template). Kept as it is when it already holds SOURCE's conversion."""
    from rich.console import Console

    from neffkit.checkpoints.gguf import convert_gguf

    with Console(stderr=True).status(f"converting {source.name}"):
        result = convert_gguf(source, out, dtype=dtype)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "out": str(result.out),
                    "architecture": result.architecture,
                    "tensors": result.tensors,
                    "parameters": result.parameters,
                    "reused": result.reused,
                }
            )
        )
        return
    verb = "already converted" if result.reused else "converted"
    click.echo(f"{out}: {verb} ({result.architecture}, {result.parameters / 1e6:.1f}M parameters)")
