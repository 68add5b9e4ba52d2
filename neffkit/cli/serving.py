"""`neffkit run BUNDLE` without a prompt: the server, from the command's options."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def serve_bundle(
    bundle: Path,
    executor: str,
    dist_timeout: float,
    no_prefix_caching: bool,
    no_speculation: bool,
    server: dict[str, Any],
) -> int:
    """Serve until stopped; the exit status. `server`: the server-only options, by click's
    names (host, port, api_key, ..., strict_requests)."""
    from neffkit.runtime.serve.access import HttpLimits
    from neffkit.runtime.serve.api_server import ChatOptions, EngineOptions, serve

    limits = HttpLimits(
        max_request_bytes=server["max_request_bytes"],
        header_timeout_s=server["header_timeout"],
        keep_alive_s=server["timeout_keep_alive"],
    )
    engine = EngineOptions(
        executor=executor,
        dist_timeout_s=dist_timeout,
        prefix_caching=not no_prefix_caching,
        speculation=not no_speculation,
        threads=server["threads"],
        max_cpu_loras=server["max_cpu_loras"],
        scheduling=server["scheduling"],
        data_parallel=server["data_parallel"],
    )
    return serve(
        bundle,
        host=server["host"],
        port=server["port"],
        api_key=server["api_key"],
        model_name=server["served_model_name"],
        max_waiting=server["max_waiting"],
        strict_requests=server["strict_requests"],
        access_log=not server["no_access_log"],
        chat=ChatOptions(
            server["tool_parser"], server["reasoning_parser"], server["chat_template"]
        ),
        compact_json=server["compact_json"],
        grammar_timeout_s=server["grammar_timeout"],
        http_limits=limits,
        public_metrics=server["public_metrics"],
        lora_modules=server["lora_modules"],
        engine=engine,
    )
