"""`neffkit run BUNDLE` without a prompt: the server, from the command's options."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neffkit.runtime.serve.api_server import EngineOptions


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
    if server["ray_address"]:
        return _serve_on_ray(str(bundle), engine, server)
    limits = HttpLimits(
        max_request_bytes=server["max_request_bytes"],
        header_timeout_s=server["header_timeout"],
        keep_alive_s=server["timeout_keep_alive"],
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


def _serve_on_ray(bundle: str, engine: EngineOptions, server: dict[str, Any]) -> int:
    """The replicas as a Ray Serve application on the cluster at --ray-address."""
    from neffkit.errors import NeffkitError

    if server["lora_modules"]:
        raise NeffkitError("--lora-modules: adapters are not served over Ray yet (--ray-address)")
    try:
        from neffkit.runtime.replicas.ray_serve import (
            FrontOptions,
            ReplicaOptions,
            local_path,
            serve_on_ray,
        )
    except ImportError as exc:
        raise NeffkitError(
            f"--ray-address needs Ray Serve ({exc.name} is not installed)",
            hint="pip install 'neffkit[ray-serve]'",
        ) from None
    from neffkit.contract.read import read_bundle

    name = server["served_model_name"] or read_bundle(local_path(bundle), verify=False).record.name
    replica = ReplicaOptions(
        bundle=bundle, model_name=name, max_waiting=server["max_waiting"], engine=engine
    )
    front = FrontOptions(
        bundle=bundle,
        model_name=name,
        max_waiting=server["max_waiting"],
        api_key=server["api_key"],
        tool_parser=server["tool_parser"],
        reasoning_parser=server["reasoning_parser"],
        chat_template=server["chat_template"],
        strict_requests=server["strict_requests"],
        compact_json=server["compact_json"],
        grammar_timeout_s=server["grammar_timeout"],
        public_metrics=server["public_metrics"],
    )
    host, port = server["host"], server["port"]
    return serve_on_ray(server["ray_address"], host, port, engine.data_parallel, replica, front)
