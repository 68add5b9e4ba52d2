"""Open a bundle, check it fits this host, and load one executable per graph.

Graphs load through `neffkit.platform.aoti.load_package`, the C++ package loader called directly
(`torch._inductor.aoti_load_package` imports the whole compile stack and is slow to start).
Checks run before anything is loaded, each with the reason and a hint: target, torch version,
CPU ISA, world size, file hashes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from neffkit.contract import abi
from neffkit.contract.abi import GraphKey, Phase
from neffkit.contract.bundle import Bundle, rank_files, verify_files
from neffkit.contract.read import read_bundle
from neffkit.contract.tensor_files import map_tensors
from neffkit.errors import BundleError
from neffkit.platform import heap, host
from neffkit.platform.cpu_kernels import load_library
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.tokenizer import Tokenizer
from neffkit.runtime.worker.adapters import AdapterSlots, allocate_slots
from neffkit.runtime.worker.executors import (
    AotiExecutor,
    Executor,
    NeuronExecutor,
    XlaCpuExecutor,
    XlaCpuSpmdExecutor,
    check_neff,
    choose_executor,
)
from neffkit.runtime.worker.kv import allocate_kv_cache
from neffkit.runtime.worker.runner import GraphEntry, ModelRunner

log = logging.getLogger(__name__)


def _base_version(version: str) -> str:
    return version.split("+")[0]


def check_host(bundle: Bundle, world_size: int = 1) -> None:
    """Refuse a bundle this process cannot run, saying what differs and how to fix it."""
    record = bundle.record
    target = record.target
    built_torch = record.versions.torch
    # HLO modules and NEFFs do not depend on torch; AOTInductor packages do
    if target != "neuron" and _base_version(built_torch) != _base_version(torch.__version__):
        raise BundleError(
            f"{bundle.root}: built with torch {built_torch}, this host has torch "
            f"{torch.__version__}"
            " (AOTInductor artifacts are tied to the torch version that compiled them)",
            hint=f"install torch=={_base_version(built_torch)}, or rebuild the bundle here",
        )
    need = record.host
    if need.machine and need.machine != host.machine():
        raise BundleError(
            f"{bundle.root}: built for {need.machine}, this host is {host.machine()}",
            hint="rebuild the bundle on this kind of host",
        )
    if target == "cpu":
        missing = sorted(set(need.cpu_flags or ()) - host.cpu_flags())
        if missing:
            raise BundleError(
                f"{bundle.root}: compiled for a CPU with {', '.join(missing)}, "
                "which this CPU lacks",
                hint="rebuild the bundle on this host, or for its CPU class "
                "(NEFFKIT_CPU_ISA=avx2 neffkit build ... runs on any AVX2 host)",
            )
    elif target == "cuda" and not torch.cuda.is_available():
        raise BundleError(f"{bundle.root}: a cuda bundle needs a CUDA device; none is visible")
    elif target not in ("cpu", "cuda", "neuron"):
        raise BundleError(
            f"{bundle.root}: target {target!r} bundles cannot run in this runtime",
            hint="see the targets table in docs/design.md#targets",
        )
    expected = record.world_size
    if world_size != expected:
        raise BundleError(
            f"{bundle.root}: built for {expected} rank(s), launched with {world_size}",
            hint=f"launch {expected} rank(s)",
        )


@dataclass
class LoadedBundle:
    """One rank's view of a bundle: its graphs (ready to run, weights and KV cache bound)."""

    bundle: Bundle
    runner: ModelRunner
    tokenizer: Tokenizer | None
    load_seconds: float
    warm_up_seconds: float = 0.0  # of load_seconds: every graph's first call (runner.warm_up)
    verify: bool = True  # how it was loaded: a draft model's bundle inside loads alike
    executor: str = "auto"
    adapters: AdapterSlots | None = None  # this rank's adapter slots (bundles with `lora:`)


def runtime_lnc(bundle: Bundle) -> int:
    """The logical-core size the Neuron runtime will use: its env setting, else the bundle's."""
    configured = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if configured:
        return int(configured)
    if bundle.record.neuron is None:
        raise BundleError(f"{bundle.root}: not a neuron bundle (no lnc recorded)")
    return bundle.record.neuron.lnc


def _executor(
    bundle: Bundle,
    chosen: str,
    statics: list[torch.Tensor],
    names: list[str],
    rank: int,
    world_size: int,
) -> Executor:
    if chosen == "xla-cpu":
        return XlaCpuExecutor(statics, names)
    if chosen == "neuron":
        return NeuronExecutor(statics, names, rank, world_size, runtime_lnc(bundle))
    return AotiExecutor(statics, names, "cuda" if bundle.target == "cuda" else "cpu")


def _rank_statics(bundle: Bundle, rank: int, device: str) -> tuple[list[torch.Tensor], list[str]]:
    """One rank's static graph inputs, in graph order: its rank (where graphs take it), fresh
    K/V caches, the decode state (decode_state: device), empty adapter slots (`lora:`), its
    weight shard (mapped, not read: the first step pages the weights in)."""
    lay = bundle.record.layout
    shard = bundle.record.weights_of(rank)
    tensors = map_tensors(bundle.path(shard.file))
    weights = [tensors[name].to(device) for name in shard.names]
    kv_names = lay.kv_names
    # each cache tensor as the graphs take it (its KV group's pool: contract/kv_groups.py)
    shapes = {t.name: t.shape for t in bundle.record.graphs[0].inputs}
    kv = allocate_kv_cache([shapes[n] for n in kv_names], getattr(torch, lay.kv_dtype), device)
    rank_input = [torch.tensor([rank], dtype=torch.int64, device=device)] if lay.rank_input else []
    state = [torch.zeros(lay.num_blocks, dtype=torch.int64, device=device) for _ in lay.state_names]
    adapters = allocate_slots(lay.lora, lay.tp, device) if lay.lora else []
    adapter_names = lay.lora.names() if lay.lora else []
    names = [abi.RANK] * len(rank_input) + kv_names + lay.state_names + adapter_names
    return rank_input + kv + state + adapters + weights, names + list(shard.names)


def _spmd(bundle: Bundle, executor: str) -> bool:
    """Does this load run every rank in one process (XLA:CPU's SPMD over host devices)?"""
    if executor != "xla-cpu" or bundle.record.world_size == 1:
        return False
    if any(g.ranks != "all" for g in bundle.record.graphs):
        raise BundleError(
            f"{bundle.root}: per-rank artifacts cannot run as SPMD on XLA:CPU",
            hint="build without parallel.per_rank_artifacts",
        )
    return True


def load(
    path: str | Path,
    rank: int = 0,
    world_size: int = 1,
    verify: bool = True,
    executor: str = "auto",
) -> LoadedBundle:
    """One rank's load; with `--executor xla-cpu` a multi-rank bundle loads every rank in this
    process (SPMD over host devices: `world_size` is then the bundle's)."""
    t0 = time.perf_counter()
    heap.pin_mmap_threshold()  # a step's freed transients leave the process (platform/heap.py)
    bundle = read_bundle(path, verify=False)
    record = bundle.record
    spmd = _spmd(bundle, executor)
    if spmd:
        rank, world_size = 0, record.world_size
    if verify:  # what this rank reads, in parallel (`inspect --verify` hashes everything)
        ranks = range(world_size) if spmd else (rank,)
        verify_files(bundle, sorted({f for r in ranks for f in rank_files(record, r)}))
    check_host(bundle, world_size)
    # refuse a wrong executor or an unfit NEFF before loading any weights
    chosen = choose_executor(bundle, executor)
    if chosen == "neuron":
        for g in bundle.graphs:
            check_neff(bundle, g, runtime_lnc(bundle))
    for library in record.kernels:  # ops the graphs call (neffkit/cpu_kernels.py)
        load_library(bundle.path(library))
    device = "cuda" if record.target == "cuda" else "cpu"
    statics_list, names = _rank_statics(bundle, rank, device)
    by_rank = {rank: statics_list}
    run_with: Executor
    if spmd:
        by_rank |= {r: _rank_statics(bundle, r, device)[0] for r in range(1, world_size)}
        run_with = XlaCpuSpmdExecutor(list(by_rank.values()), names)
    else:
        run_with = _executor(bundle, chosen, statics_list, names, rank, world_size)
    entries = _graph_entries(bundle, rank, set(names), run_with)
    runner = ModelRunner(entries, SchedulerConfig.of(record))
    # AOTInductor's graphs pay their first call at load (a Neuron runtime warms its own)
    warm_up_s = runner.warm_up() if run_with.name == "aotinductor" else 0.0
    tokenizer = Tokenizer.from_dir(bundle.path(record.tokenizer)) if record.tokenizer else None
    adapters = _adapter_slots(bundle, names, by_rank, run_with)
    heap.release_free_memory()
    return LoadedBundle(
        bundle,
        runner,
        tokenizer,
        load_seconds=time.perf_counter() - t0,
        warm_up_seconds=warm_up_s,
        verify=verify,
        executor=executor,
        adapters=adapters,
    )


def _graph_entries(
    bundle: Bundle, rank: int, statics: set[str], run_with: Executor
) -> list[GraphEntry]:
    """The graphs this rank runs, each loaded by its executor. Per-rank artifacts
    (parallel.per_rank_artifacts) list their rank; SPMD ones serve "all"."""
    entries = []
    for g in (g for g in bundle.record.graphs if g.serves(rank)):
        meta = tuple((i.name, i.shape, i.dtype) for i in g.inputs if i.name not in statics)
        b = g.buckets
        entries.append(
            GraphEntry(
                name=g.name,
                key=GraphKey(Phase(g.phase), b.rows, b.tokens, b.context),
                meta_specs=meta,
                run=run_with.load(bundle, g, len(meta)),
                outputs=tuple(o.name for o in g.outputs),
            )
        )
    return entries


def _adapter_slots(
    bundle: Bundle, names: list[str], by_rank: dict[int, list[torch.Tensor]], run_with: Executor
) -> AdapterSlots | None:
    """The adapter slots of the ranks this process holds, written through its executor (None:
    built without `lora:`)."""
    lay = bundle.record.layout
    if lay.lora is None:
        return None
    index = {name: i for i, name in enumerate(names)}
    tensors = {
        rank: [statics[index[name]] for name in lay.lora.names()]
        for rank, statics in by_rank.items()
    }
    return AdapterSlots(lay.lora, tensors, run_with.refresh, lay.tp)
