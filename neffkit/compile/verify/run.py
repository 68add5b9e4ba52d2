"""`neffkit build --verify`: run each built graph against the eager model on representative inputs.

Representative inputs are real: the bundle's own weights (rank 0), a random but fixed prompt and
K/V context, padded rows and tokens like the runtime sends, greedy sampling. The artifact runs
where it can run here: the AOTInductor package (cpu, cuda) or the HLO module on XLA:CPU (neuron;
the NEFF itself needs a NeuronCore). The numbers recorded are token equality, the largest
difference of the returned logprobs (a function of the final logits; an embed bundle's: of the
pooled states, tokens then counting as equal) and the largest K/V-cache
difference over every layer (every layer's K/V is a function of the hidden states before it).
cpu/cuda graphs at tp > 1 are skipped: their eager model needs every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from neffkit.compile.layout import graph_inputs, model_layout
from neffkit.compile.trace import decoder_module
from neffkit.compile.units import GraphSpec, ModelLayout, Runner, SpmdRunner
from neffkit.compile.verify.inputs import representative_inputs
from neffkit.contract.records import IoAlias, VerifyRecord
from neffkit.errors import BuildError
from neffkit.models.weights import iter_rank_weights
from neffkit.platform.aoti import load_package
from neffkit.platform.xla_cpu import to_numpy

if TYPE_CHECKING:
    from neffkit.compile.backends.base import Backend
    from neffkit.compile.progress import Progress
    from neffkit.compile.units import GraphUnit
    from neffkit.manifest import Manifest

# largest K/V difference tolerated per dtype (fp32 differences seen: ≤ 1e-6)
KV_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
# largest logprob difference (logprobs are float32 from the logits of the graph's dtype)
LOGPROB_TOLERANCE = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.25}
LOGPROB_OUTPUTS = (1, 3)  # token_logprobs, top_logprobs (graph_outputs' order)


@dataclass(frozen=True)
class VerifyResult:
    tokens_equal: bool
    max_kv_error: float
    tolerance: float
    executor: str
    max_logprob_error: float = 0.0
    logprob_tolerance: float = 0.0
    near_ties: int = 0  # rows whose greedy token differs only between near-equal logprobs

    @property
    def ok(self) -> bool:
        return (
            (self.tokens_equal or self.near_ties > 0)
            and self.max_kv_error <= self.tolerance
            and self.max_logprob_error <= self.logprob_tolerance
        )

    def record(self) -> VerifyRecord:
        return VerifyRecord(
            ok=self.ok,
            tokens_equal=self.tokens_equal,
            max_kv_error=self.max_kv_error,
            tolerance=self.tolerance,
            executor=self.executor,
            max_logprob_error=self.max_logprob_error,
            near_ties=self.near_ties or None,
        )


def eager_runner(layout: ModelLayout, spec: GraphSpec) -> Runner:
    # projections as matmuls in the reference: the broadcast forms Inductor fuses into
    # reductions would materialise a [rows, out, in] product in eager mode (1 GB for a
    # 128k-vocab LM head); attention in the graph's own form, which checks the cpu kernel
    eager = dataclasses.replace(
        layout.projection, max_rows=0, attention_kernel=False, lora_kernel=False
    )
    module, specs = decoder_module(dataclasses.replace(layout, projection=eager), spec)
    names = [s.name for s in specs]

    def run(inputs: list[torch.Tensor]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        with torch.no_grad():
            outputs = module(*inputs)
        return [o.numpy() for o in outputs], _kv_by_name(names, inputs)

    return run


def aoti_runner(artifact: Path, names: list[str]) -> Runner:
    loader = load_package(artifact)

    def run(inputs: list[torch.Tensor]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        outputs = loader.run(inputs)
        return [o.numpy() for o in outputs], _kv_by_name(names, inputs)

    return run


def xla_cpu_runner(
    proto: bytes, names: list[str], io_alias: tuple[IoAlias, ...], num_outputs: int
) -> Runner:
    from neffkit.platform.xla_cpu import XlaCpu

    xla = XlaCpu()
    executable = xla.compile(proto)

    def run(inputs: list[torch.Tensor]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        outs = xla.run(executable, [xla.put(to_numpy(t)) for t in inputs])
        kv = {a.input: np.asarray(outs[a.output]) for a in io_alias}
        return [np.asarray(o) for o in outs[-num_outputs:]], kv

    return run


def xla_spmd_runner(
    proto: bytes, names: list[str], io_alias: tuple[IoAlias, ...], num_outputs: int, ranks: int
) -> SpmdRunner:
    """The HLO as SPMD over `ranks` XLA:CPU host devices (its all-reduces run for real)."""
    from neffkit.platform.xla_cpu import XlaCpu

    xla = XlaCpu(devices=ranks)
    executable = xla.compile(proto)

    def run(
        inputs_by_rank: list[list[torch.Tensor]],
    ) -> tuple[list[np.ndarray], list[dict[str, np.ndarray]]]:
        args = [
            xla.put_ranks([to_numpy(inputs[i]) for inputs in inputs_by_rank])
            for i in range(len(names))
        ]
        outs = xla.run_ranks(executable, args)
        kv = [{a.input: np.asarray(outs[a.output][r]) for a in io_alias} for r in range(ranks)]
        return [np.asarray(o[0]) for o in outs[-num_outputs:]], kv

    return run


def _kv_by_name(names: list[str], inputs: list[torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: t.float().numpy() for n, t in zip(names, inputs, strict=True) if "_cache." in n}


def verify_graph(
    layout: ModelLayout,
    spec: GraphSpec,
    weights: list[torch.Tensor],
    runner: Runner,
    executor: str,
) -> VerifyResult:
    """Run eager and artifact on the same inputs (each on its own copy of the K/V caches)."""
    inputs = representative_inputs(layout, spec, weights)
    want, want_kv = eager_runner(layout, spec)([t.clone() for t in inputs])
    try:
        got, got_kv = runner([t.clone() for t in inputs])
    except Exception as exc:
        raise BuildError(f"{spec.name}: --verify could not run the artifact: {exc}") from exc
    return _compare(layout, want, want_kv, got, got_kv, executor)


def verify_spmd_graph(
    layout: ModelLayout,
    reference: ModelLayout,
    spec: GraphSpec,
    full_weights: list[torch.Tensor],
    rank_weights: list[dict[str, torch.Tensor]],
    runner: SpmdRunner,
    executor: str,
) -> VerifyResult:
    """A tp > 1 artifact, every rank at once, against the tp=1 eager model on the whole
    checkpoint: the same metadata, each rank's K/V cache the slice of the reference's that holds
    its heads; rank 0's outputs and every rank's K/V are compared."""
    cfg, par = layout.config, layout.par
    ref_inputs = representative_inputs(reference, spec, full_weights)
    want, want_kv = eager_runner(reference, spec)([t.clone() for t in ref_inputs])
    ref_by_name = dict(
        zip([s.name for s in graph_inputs(reference, spec)[1]], ref_inputs, strict=True)
    )
    heads = [
        slice(0, None) if cfg.kv_kind == "mla" else slice(h0, h0 + layout.kv_heads)
        for h0 in (cfg.kv_head_start(par, r) for r in range(par.tp))
    ]
    specs = graph_inputs(layout, spec)[1]
    by_rank = []
    for rank in range(par.tp):
        inputs = []
        for s in specs:
            if s.name == "rank":
                inputs.append(torch.tensor([rank], dtype=torch.int64))
            elif "_cache." in s.name:
                inputs.append(ref_by_name[s.name][:, :, heads[rank]].clone())
            elif s.name in rank_weights[rank]:
                inputs.append(rank_weights[rank][s.name])
            else:
                inputs.append(ref_by_name[s.name].clone())
        by_rank.append(inputs)
    try:
        got, got_kv = runner(by_rank)
    except Exception as exc:
        raise BuildError(f"{spec.name}: --verify could not run the artifact: {exc}") from exc
    ranks = range(par.tp)  # each rank's cache against its slice of the reference's
    want_slices = {
        f"{n} (rank {r})": kv[:, :, heads[r]] for n, kv in want_kv.items() for r in ranks
    }
    got_slices = {f"{n} (rank {r})": got_kv[r][n] for n in want_kv for r in ranks}
    return _compare(layout, want, want_slices, got, got_slices, executor)


def _compare(
    layout: ModelLayout,
    want: list[np.ndarray],
    want_kv: dict[str, np.ndarray],
    got: list[np.ndarray],
    got_kv: dict[str, np.ndarray],
    executor: str,
) -> VerifyResult:
    err = max(
        float(np.abs(got_kv[name].astype(np.float64) - want_kv[name]).max()) for name in want_kv
    )
    # the tolerance is per unit of magnitude: low-precision rounding grows with the values
    scale = max(1.0, max(float(np.abs(want_kv[name]).max()) for name in want_kv))
    tolerance = KV_TOLERANCE.get(layout.dtype, 5e-2)
    if layout.pooling:  # an embed bundle's pooled states, held to the K/V's tolerance
        pooled_err = float(np.abs(got[0].astype(np.float64) - want[0]).max())
        pooled_scale = max(1.0, float(np.abs(want[0]).max()))
        return VerifyResult(
            tokens_equal=True,
            max_kv_error=err,
            tolerance=tolerance * scale,
            executor=executor,
            max_logprob_error=pooled_err,
            logprob_tolerance=tolerance * pooled_scale,
        )
    logprob_err = max(
        float(np.abs(got[i].astype(np.float64) - want[i]).max()) for i in LOGPROB_OUTPUTS
    )
    logprob_tol = LOGPROB_TOLERANCE.get(layout.dtype, 0.25)
    equal = bool(np.array_equal(got[0], want[0]))
    return VerifyResult(
        tokens_equal=equal,
        max_kv_error=err,
        tolerance=tolerance * scale,
        executor=executor,
        max_logprob_error=logprob_err,
        logprob_tolerance=logprob_tol,
        near_ties=0 if equal else near_ties(got[0], want, logprob_tol),
    )


def near_ties(got_tokens: np.ndarray, want: list[np.ndarray], tolerance: float) -> int:
    """Rows whose greedy tokens differ, if every such row is a near tie, else 0.

    A near tie: the reference ranks the artifact's token among its top logprobs, within
    `tolerance` of its own choice. Rounding of the graph's dtype legitimately flips those (random
    checkpoints at scale have many), and the logprob outputs are compared on their own."""
    ids, values = want[2], want[3]  # top_logprob_ids [B, N], top_logprobs [B, N]
    rows = np.flatnonzero(got_tokens.reshape(-1) != want[0].reshape(-1))
    for row in rows:
        hit = np.flatnonzero(ids[row] == got_tokens.reshape(-1)[row])
        if not hit.size or values[row, 0] - values[row, hit[0]] > tolerance:
            return 0
    return len(rows)


def _tokens_word(outcome: VerifyResult) -> str:
    if outcome.tokens_equal:
        return "equal"
    if outcome.near_ties:
        return f"equal but {outcome.near_ties} near tie(s)"
    return "DIFFER"


def verify_units(
    manifest: Manifest,
    layout: ModelLayout,
    backend: Backend,
    stage: Path,
    units: list[GraphUnit],
    progress: Progress,
) -> None:
    """`--verify`: each graph against the eager model; a mismatch fails the build. tp > 1
    graphs run every rank at once where the backend can (neuron: the HLO over host devices),
    against the tp=1 eager model on the whole checkpoint; elsewhere they are skipped."""
    from safetensors.torch import load_file

    tp = layout.par.tp
    spmd = [backend.spmd_runner(u, tp) for u in units] if tp > 1 else []
    if tp > 1 and any(r is None for r in spmd):
        for u in units:
            u.verify = VerifyRecord(skipped="tp > 1: the eager model needs every rank")
        progress.message("verify: skipped (tp > 1 graphs need every rank to run eagerly)")
        return
    shards = [load_file(str(stage / "weights" / f"rank{rank}.safetensors")) for rank in range(tp)]
    weights = [shards[0][w.name] for w in layout.weights]
    reference, full = None, []
    if tp > 1:  # the tp=1 eager model on the whole checkpoint (held in memory for verify)
        one = replace(manifest, parallel=replace(manifest.parallel, tp=1, ep=1))
        reference = model_layout(one, layout.device)
        whole = dict(
            iter_rank_weights(one.model, one.model_config, reference.storage, reference.par, 0)
        )
        full = [whole[w.name] for w in reference.weights]
    failed = []
    for i, u in enumerate(units):
        if reference is not None:
            runner, executor = spmd[i]  # type: ignore[misc]
            outcome = verify_spmd_graph(layout, reference, u.spec, full, shards, runner, executor)
        else:
            runner, executor = backend.verify_runner(layout, u, stage)
            outcome = verify_graph(layout, u.spec, weights, runner, executor)
        u.verify = outcome.record()
        progress.message(
            f"verify {u.stem}: tokens {_tokens_word(outcome)}, "
            f"max K/V error {outcome.max_kv_error:.2e}, "
            f"max logprob error {outcome.max_logprob_error:.2e} ({executor})"
        )
        if not outcome.ok:
            failed.append(u.stem)
    if failed:
        raise BuildError(
            f"--verify: {', '.join(failed)} disagree with the eager model",
            hint="inspect the graph (`neffkit inspect BUNDLE --graph NAME`) and the options "
            "applied to it; a bad compiler option is the usual cause",
        )
