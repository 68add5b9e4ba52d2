"""`neffkit run`: generate from a bundle, or serve it (no prompt: the OpenAI-compatible API)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from neffkit.cli.app import cli, local_bundle
from neffkit.cli.outputs import shown
from neffkit.cli.serving import serve_bundle
from neffkit.errors import NeffkitError
from neffkit.runtime.config import POLICIES, SchedulingOptions
from neffkit.runtime.sampling_params import OFFLINE
from neffkit.runtime.serve.reasoning import PARSERS as REASONING_PARSERS

LORA_MODULES = "--lora-modules"


class _RunCommand(click.Command):
    """`run`, whose `--lora-modules` takes several values after one flag as vLLM's does (argparse
    nargs="+"): each argument after its value that reads as one more (NAME=PATH, or a JSON
    object) is one more `--lora-modules`; repeating the flag works too."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _spread(args, LORA_MODULES))


def _spread(args: list[str], flag: str) -> list[str]:
    """`flag a b c` as `flag a flag b flag c`, up to an argument that is not a value."""
    out: list[str] = []
    state = ""  # "value": the next argument is the flag's; "more": more values may follow
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if state == "value":
            out.append(arg)
            state = "more"
            continue
        if state == "more" and not arg.startswith("-") and ("=" in arg or arg.startswith("{")):
            out += [flag, arg]
            continue
        state = "value" if arg == flag else "more" if arg.startswith(flag + "=") else ""
        out.append(arg)
    return out


def _lora_modules(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> list:
    """Each `--lora-modules` value as a LoraModule (a bad one: a usage error, exit 2)."""
    if not values:
        return []
    from neffkit.runtime.serve.lora import parse_lora_module

    try:
        return [parse_lora_module(v) for v in values]
    except NeffkitError as exc:
        raise click.BadParameter(exc.message, param_hint=LORA_MODULES) from None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise NeffkitError(f"--prompt-ids: expected comma-separated ints, got {text!r}") from exc


@cli.command(cls=_RunCommand)
@click.argument("bundle", callback=lambda _ctx, _param, value: local_bundle(value))
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Prompt token ids: 1,2,3.")
@click.option(
    "--chat",
    "chats",
    multiple=True,
    help="A user message, rendered through the bundle's chat template (repeatable).",
)
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
@click.option(
    "--no-prefix-caching",
    "no_prefix_caching",
    is_flag=True,
    help="Compute every prompt whole (the bundle shares cached prompt blocks by default).",
)
@click.option(
    "--no-speculation",
    "no_speculation",
    is_flag=True,
    help="Decode one token a step in a bundle built with speculation.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Engine threads (default: $NEFFKIT_ENGINE_THREADS, else the CPUs this process may use: "
    "its affinity and cgroup quota).",
)
@click.option(
    "--data-parallel",
    "data_parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Server: engine replicas, each on its share of the CPUs, behind the one server.",
)
@click.option(
    "--ray-address",
    "ray_address",
    default=None,
    metavar="ADDR",
    help="Server: place the --data-parallel replicas on the Ray cluster at ADDR, as a Ray Serve "
    "application (BUNDLE a path every node sees, or a pack URL).",
)
@click.option(
    "--lora",
    default=None,
    metavar="[NAME=]PATH",
    help="Generate with the PEFT adapter at PATH (a bundle built with lora:).",
)
@click.option(
    LORA_MODULES,
    "lora_modules",
    multiple=True,
    callback=_lora_modules,
    metavar="NAME=PATH ...",
    help="Server: serve the PEFT adapter at PATH as model NAME (a bundle built with lora:); "
    'several may follow one flag; or JSON: {"name": ..., "path": ..., "base_model_name": ...}.',
)
@click.option(
    "--max-cpu-loras",
    type=click.IntRange(min=1),
    default=None,
    help="Server: adapters kept read in memory (default and at least: the bundle's max_loras); "
    "one evicted is read again from its directory when next asked for.",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(POLICIES),
    default="fcfs",
    show_default=True,
    help="Who waits and who is preempted when KV blocks run short: arrival order, or each "
    "request's `priority` (lower first, ties by arrival; vLLM's).",
)
@click.option(
    "--num-gpu-blocks-override",
    "num_blocks",
    type=click.IntRange(min=2),
    default=None,
    help="Use this many KV blocks (the null block included, as vLLM counts) of the bundle's.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Server: address to bind.")
@click.option("--port", default=8000, show_default=True, type=int, help="Server: port.")
@click.option(
    "--api-key",
    envvar="NEFFKIT_API_KEY",
    help="Server: require `Authorization: Bearer KEY` on every route but /health "
    "(env NEFFKIT_API_KEY).",
)
@click.option(
    "--public-metrics",
    "public_metrics",
    is_flag=True,
    help="Server: with --api-key, leave /metrics open too (a Prometheus scraper without the key).",
)
@click.option(
    "--max-request-bytes",
    default=16 * 2**20,  # HttpLimits' defaults (serve/access.py), here and below
    show_default=True,
    type=click.IntRange(min=1),
    help="Server: a request body over this many bytes gets 413.",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Server: seconds a client has to send a request's line and headers whole (from the "
    "connection's opening or the previous response's end) before the connection is closed.",
)
@click.option(
    "--timeout-keep-alive",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Server: seconds an idle keep-alive connection stays open.",
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
@click.option(
    "--no-access-log",
    "no_access_log",
    is_flag=True,
    help="Server: no access log line per request (method, path, status, latency, request id).",
)
@click.option(
    "--strict-requests",
    "strict_requests",
    is_flag=True,
    help="Server: refuse request fields it does not know with a 400 (default: log them once "
    "as ignored).",
)
@click.option(
    "--tool-call-parser",
    "tool_parser",
    type=click.Choice(["auto", "hermes", "llama3_json"]),
    default="auto",
    show_default=True,
    help="Server: find tool calls in the model's text for tool_choice auto (the model's format: "
    "<tool_call> JSON, or Llama 3's JSON); auto picks it from the chat template. A template "
    "without tools gets them in hermes's format in the system message.",
)
@click.option(
    "--chat-template",
    "chat_template",
    default=None,
    callback=lambda ctx, param, value: _chat_template(value),
    help="Server: render conversations with this chat template instead of the bundle's: a Jinja "
    "file's path, or the template itself (vLLM's).",
)
@click.option(
    "--reasoning-parser",
    "reasoning_parser",
    type=click.Choice(REASONING_PARSERS),
    default=None,
    help="Server: split a reasoning model's <think>...</think> into the chat message's "
    "reasoning_content (qwen3: where the output opens with <think>; deepseek_r1: up to "
    "</think>).",
)
@click.option(
    "--disable-any-whitespace",
    "compact_json",
    is_flag=True,
    help="Server: JSON constraints allow no whitespace between tokens unless a request asks "
    "(structured_outputs.disable_any_whitespace: false); small models wander in whitespace.",
)
@click.option(
    "--grammar-timeout",
    default=5.0,  # GrammarLimits.timeout_s (engine/structured.py)
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Server: seconds a new structured-output grammar may take to compile; slower ones get "
    "a 400 naming the field.",
)
def run(
    bundle: Path,
    prompts: tuple[str, ...],
    prompt_ids: tuple[str, ...],
    chats: tuple[str, ...],
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    ignore_eos: bool,
    as_json: bool,
    dist_timeout: float,
    executor: str,
    no_prefix_caching: bool,
    no_speculation: bool,
    threads: int | None,
    lora: str | None,
    **server: Any,
) -> None:
    """Generate from BUNDLE (with --prompt, --chat or --prompt-ids), or serve the OpenAI API
    (without)."""
    from neffkit.runtime.engine.llm import GenerateRequest, run_offline
    from neffkit.runtime.sampling_params import SamplingParams

    scheduling = _scheduling(server)
    if not prompts and not prompt_ids and not chats:  # no prompt: serve the OpenAI API
        server["threads"], server["scheduling"] = threads, scheduling
        sys.exit(
            serve_bundle(bundle, executor, dist_timeout, no_prefix_caching, no_speculation, server)
        )
    _server_only(server)

    request = GenerateRequest(
        texts=list(prompts),
        token_ids=[_parse_ids(p) for p in prompt_ids],
        chats=list(chats),
        params=SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        ),
        prefix_caching=not no_prefix_caching,
        speculation=not no_speculation,
        threads=threads,
        lora=_named_path(lora, "--lora") if lora else None,
        scheduling=scheduling,
    )
    # JSON as run_offline writes it: "outputs", each with "text" and "token_ids"
    report: dict[str, Any] | None = run_offline(bundle, request, dist_timeout, executor)
    if report is None:  # a follower rank of a torchrun launch: rank 0 prints
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for out in report["outputs"]:
        click.echo(shown(out))


def _server_only(server: dict[str, Any]) -> None:
    """A usage error for a server option given with a prompt."""
    if server["lora_modules"]:
        raise click.UsageError(f"{LORA_MODULES} is the server's; with a prompt, use --lora")
    if server["data_parallel"] > 1 or server["ray_address"]:
        raise click.UsageError(
            "--data-parallel and --ray-address are the server's; a prompt runs on one engine"
        )


def _chat_template(value: str | None) -> str | None:
    """--chat-template's text: a file's, or the value itself where it holds Jinja; checked."""
    if value is None:
        return None
    path = Path(value)
    text = path.read_text() if path.is_file() else value
    if text is value and "{" not in value:
        raise click.BadParameter(f"{value}: no such file", param_hint="--chat-template")
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise click.BadParameter(
            f"not a Jinja template: {exc}", param_hint="--chat-template"
        ) from None
    return text


def _scheduling(options: dict[str, Any]) -> SchedulingOptions:
    """--scheduling-policy and --num-gpu-blocks-override (taken out of `options`), offline and
    served alike."""
    return SchedulingOptions(options.pop("scheduling_policy"), options.pop("num_blocks"))


def _named_path(value: str, option: str) -> tuple[str, str]:
    """`--lora`: what `--lora-modules` takes (NAME=PATH, or JSON), or a bare PATH named after
    its last part."""
    from neffkit.runtime.serve.lora import parse_lora_module

    bare = "=" not in value and not value.lstrip().startswith("{")
    try:
        module = parse_lora_module(f"{Path(value).name}={value}" if bare else value)
    except NeffkitError as exc:
        raise click.BadParameter(exc.message, param_hint=option) from None
    return module.name, module.path
