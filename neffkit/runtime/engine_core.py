"""The engine core: a process of its own that owns the bundle and runs `Engine.step` in a loop.

An AOTInductor graph call holds the GIL for its whole run, so an engine thread inside the HTTP
server serialises every graph call with all request handling. As in vLLM's V1 engine core, the
engine runs in its own process and talks to the server over one pipe: the server sends
`("add", id, prompt_ids, params)` and `("abort", id, reason)`, the core answers once per step
with every request's new tokens and the scheduler's state. Detokenisation stays in the server.
With tp > 1 this process is rank 0 and starts the other ranks, as an offline run does.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from neffkit.errors import RequestError
from neffkit.runtime.engine import Engine, SequenceState

# messages core → server
READY, STEP, FAILED = "ready", "step", "failed"


def _serve_engine(engine: Engine, conn: Connection) -> None:
    live: dict[int, SequenceState] = {}
    sent: dict[int, int] = {}
    conn.send((READY, engine.max_model_len))
    while True:
        if not engine.has_work():
            conn.poll(None)  # idle: sleep until the server sends something
        changed = False
        while conn.poll():
            msg = conn.recv()
            changed = True
            if msg[0] == "stop":
                return
            if msg[0] == "add":
                _, rid, prompt_ids, params = msg
                try:
                    live[rid], sent[rid] = engine.add_request(prompt_ids, params), 0
                except RequestError:  # the server validates first; this is a safety net
                    conn.send((STEP, ([(rid, [], "error")], None)))
            elif msg[0] == "abort":
                _, rid, reason = msg
                if rid in live:
                    engine.abort(live.pop(rid), reason)
                    sent.pop(rid)
        outputs = []
        if engine.has_work():
            engine.step()
            for rid, seq in list(live.items()):
                if len(seq.output_ids) == sent[rid] and not seq.finished:
                    continue
                outputs.append((rid, seq.output_ids[sent[rid] :], seq.finish_reason))
                sent[rid] = len(seq.output_ids)
                if seq.finished:
                    del live[rid], sent[rid]
        if outputs or changed:
            waiting = len(engine.waiting) + len(engine.prefilling)
            conn.send((STEP, (outputs, (len(engine.running), waiting, engine.kv_usage))))


def core_main(conn: Connection, bundle: str, executor: str, dist_timeout_s: float) -> None:
    """Entry point of the core process (spawned by the server).

    The core leaves one core to the HTTP process (`NEFFKIT_ENGINE_THREADS` overrides): on a
    2-core host that measured 1.4x the single-stream throughput of two intra-op threads
    competing with the server (bench/serve.py).
    """
    try:
        import torch

        cores = os.cpu_count() or 1
        torch.set_num_threads(int(os.environ.get("NEFFKIT_ENGINE_THREADS", 0)) or max(1, cores - 1))
        from neffkit.bundle import read_bundle
        from neffkit.runtime.distributed import launched_by_torchrun, run_ranks
        from neffkit.runtime.loader import load

        world_size = read_bundle(bundle, verify=False).record.world_size
        if world_size > 1 or launched_by_torchrun():
            run_ranks(
                bundle,
                world_size,
                lambda loaded: _serve_engine(loaded.engine, conn),
                timeout_s=dist_timeout_s,
            )
        else:
            _serve_engine(load(bundle, executor=executor).engine, conn)
    except BaseException as exc:  # noqa: BLE001 - the server reports it and stops
        from neffkit.errors import NeffkitError

        detail = exc.message if isinstance(exc, NeffkitError) else traceback.format_exc()
        try:
            conn.send((FAILED, detail))
        except OSError:
            pass


def start_core(
    bundle: Path, executor: str, dist_timeout_s: float
) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(
        target=core_main,
        args=(theirs, str(bundle), executor, dist_timeout_s),
        name="neffkit-engine-core",
        daemon=True,
    )
    proc.start()
    theirs.close()
    return proc, ours
