"""`compiler.cpu_kernel: auto`: per graph, neffkit's kernel (for the large weights, or for
every weight) or Inductor's blocked form (a reduction per row up to 8 rows, a bmm over the
blocks beyond), whichever runs that graph's projections faster on the build host.

Which form wins depends on the CPU, not only on its ISA: the kernel was tuned on an Intel host,
and on an AMD Zen 4 host Inductor's fused reduction was faster at one row (LAB.md). So, as
Inductor's max-autotune times its templates, the build times the three forms on this host for
each graph's row count (decode rows, verify and prefill tokens): every blocked projection
weight of the model (random values, the model's shapes and dtypes, as many copies as the graph
has, up to `MAX_BYTES`, a share of that beyond 8 rows, where the work grows with the rows
while the weights' reuse makes it compute-bound; there without the LM head, which a prefill
runs on its last tokens only, and at 128 rows at most, scaled), run through
`models.projection.project` compiled by Inductor under each policy, alternating, medians.
Measurements are kept per host and model shape (beside the kernel library, `cpu_kernels.cache_dir`)
so a rebuild here picks the same forms and writes the same bundle; bundle.json records them per
graph (`kernel_timing`).

A shared host makes timings noisy, and a choice made in a noisy moment would stay cached. So a
measurement runs more rounds while no form wins by NOISE (5%) or more, and keeps the default
form (the kernel) if none does after MAX_ROUNDS; the cache entry records the margin, and one
won by less than THIN (10%) is measured again at the next builds, its forms' means pooled,
until MAX_MEASUREMENTS measurements agree in one entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from neffkit.compile.layout import blocked_projections, spec_bytes
from neffkit.compile.units import NOISE, FormTiming, ModelLayout, margin_of
from neffkit.contract.abi import TensorSpec
from neffkit.models.forms import TIED_TABLE, ProjectionPolicy
from neffkit.models.projection import BlockedFp8, project
from neffkit.platform import cpu_kernels, cpus, host, isa
from neffkit.targets import DTYPE_BYTES

MAX_BYTES = 1 << 30  # weights allocated to time a graph's projections (a larger model: a share)
SHARE_ROWS = 8  # beyond this many rows, MAX_BYTES * SHARE_ROWS / rows (a bounded time to measure)
# more rows are timed at this many (both forms are compute-bound there, their time grows with
# the rows), so a long prefill bucket of a large model does not hold the build for minutes
MAX_TIMED_ROWS = 128
REPEATS = 15  # timed runs of each form a round, alternating (the host is shared: medians)
MAX_ROUNDS = 3  # rounds while no form wins by NOISE (units.py) or more; then the default form
THIN = 0.10  # a kept choice won by less than this: measured again at the next build...
MAX_MEASUREMENTS = 3  # ... until this many measurements agree in one mean
FP8 = "float8_e4m3fn"
HEADS = ("lm_head.weight", TIED_TABLE)  # the LM head, its own or the tied table


def autotuned(
    layout: ModelLayout,
    rows: list[int],
    measured: Callable[[FormTiming], object] | None = None,
) -> tuple[ModelLayout, tuple[FormTiming, ...]]:
    """The layout with each row count's projections in the form that measured fastest there
    (the kernel for the large weights, the kernel for all, or Inductor's blocked form);
    `measured` is told of each row count as it is done (the build's progress)."""
    policy = layout.projection
    weights = _timed_weights(layout)
    if policy.kernel != "auto" or not weights or not rows:
        return layout, ()
    timings = []
    for r in sorted(set(rows)):
        timings.append(_cached(layout, _run_at(weights, r), r))
        if measured is not None:
            measured(timings[-1])
    projection = dataclasses.replace(
        policy,
        kernel_rows=frozenset(t.rows for t in timings if t.chosen != "inductor"),
        kernel_all_rows=frozenset(t.rows for t in timings if t.chosen == "kernel-all"),
    )
    done = tuple(timings)
    return dataclasses.replace(layout, projection=projection, kernel_timings=done), done


def _run_at(weights: list[TensorSpec], rows: int) -> list[TensorSpec]:
    """The weights a graph of `rows` rows projects at that row count: beyond SHARE_ROWS (a
    prefill's tokens) not the LM head, which a prefill graph runs on each sequence's last token,
    a row count measured on its own (a verify graph of that many rows runs it there too, in
    the form its layers measured faster in)."""
    if rows <= SHARE_ROWS:
        return weights
    return [w for w in weights if w.name.removesuffix(".scale") not in HEADS]


def _timed_weights(layout: ModelLayout) -> list[TensorSpec]:
    """Every blocked projection weight, each followed by its scales if fp8; none where no
    weight reaches kernel_min_bytes (a model that small keeps Inductor's forms unmeasured)."""
    by_name = {w.name: w for w in layout.weights}
    blocked = blocked_projections(layout)
    out = []
    for w in blocked:
        out.append(w)
        if w.dtype == FP8:
            out.append(by_name[w.name + ".scale"])
    large = any(spec_bytes(w) >= layout.projection.kernel_min_bytes for w in blocked)
    return out if large else []


def _cached(layout: ModelLayout, weights: list[TensorSpec], rows: int) -> FormTiming:
    """A measurement this host made before for these shapes, or a new one (kept)."""
    threads = cpus.usable_cpus()
    key = json.dumps(
        [
            [(w.shape, w.dtype) for w in weights],
            rows,
            layout.dtype,
            layout.config.fp8_block,
            threads,
            torch.__version__,
            host.cpu_description(),
            sorted(host.cpu_flags()),
            isa.requested(),
            [source.read_bytes().hex() for source in cpu_kernels.code_files()],
            Path(__file__).read_bytes().hex(),
        ],
        default=list,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    path = cpu_kernels.cache_dir() / "autotune" / f"{digest}.json"
    kept = _read_entry(path)
    if kept is not None and not remeasure(kept):
        return kept
    with cpus.torch_threads(threads):
        timing = measure(layout, weights, rows)
    if kept is not None:  # a thin margin measured again: the mean of every measurement
        timing = merged(kept, timing)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**dataclasses.asdict(timing), "margin": timing.margin}))
    tmp.replace(path)
    return timing


def remeasure(kept: FormTiming) -> bool:
    """Is a kept choice thin enough, and measured few enough times, to measure again?"""
    return kept.margin < THIN and kept.measurements < MAX_MEASUREMENTS


def _read_entry(path: Path) -> FormTiming | None:
    """A kept measurement; None where there is none or it is not one this code reads."""
    try:
        entry = json.loads(path.read_text())
        entry.pop("margin", None)  # recorded for a reader; derived from the figures
        timing = FormTiming(**entry)
        usable = all(math.isfinite(ms) and ms > 0 for ms in timing.forms.values())
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return timing if usable else None


def merged(kept: FormTiming, new: FormTiming) -> FormTiming:
    """Two measurements of one row count as one: each form's mean over all of them."""
    n = kept.measurements
    ms = {f: (kept.forms[f] * n + new.forms[f]) / (n + 1) for f in kept.forms}
    return _timing(kept.rows, ms, n + 1)


def measure(layout: ModelLayout, weights: list[TensorSpec], rows: int) -> FormTiming:
    """The three forms of one row count's projections, compiled and timed alternately."""
    cpu_kernels.ensure_for_tracing()
    # each measurement compiles its three forms afresh: without a reset, Dynamo's limit of 8
    # compiles per function is reached at the third decode row count
    torch._dynamo.reset()
    dtype = getattr(torch, layout.dtype)
    timed = min(rows, MAX_TIMED_ROWS)
    max_bytes = MAX_BYTES * min(1.0, SHARE_ROWS / timed)
    share, flat, k_block = _weights(weights, layout.config.fp8_block, max_bytes)
    share *= timed / rows  # the time scaled back to the graph's rows as well
    groups = _unflatten(flat, k_block)
    xs = {k: torch.randn(timed, k).to(dtype) for k in {_in_features(w) for w in groups}}
    base = dataclasses.replace(layout.projection, kernel_rows=None, kernel_all_rows=frozenset())
    policies = {
        "kernel": dataclasses.replace(base, kernel="auto"),
        "kernel-all": dataclasses.replace(base, kernel="on"),
        "inductor": dataclasses.replace(base, kernel="off"),
    }
    runs = {form: _compiled(policy, xs, flat, k_block) for form, policy in policies.items()}
    for run in runs.values():  # warm up: first calls allocate
        run()
    return _timing(rows, timed_forms(runs, share))


def _timing(rows: int, ms: dict[str, float], measurements: int = 1) -> FormTiming:
    """The record of one row count's figures (rounded: its margin is theirs)."""
    ms = {form: round(value, 3) for form, value in ms.items()}
    return FormTiming(rows, ms["kernel"], ms["inductor"], ms["kernel-all"], measurements)


def timed_forms(runs: dict[str, Callable[[], object]], share: float) -> dict[str, float]:
    """Each form's median ms (scaled by `share`), timed alternately REPEATS times a round,
    more rounds (up to MAX_ROUNDS, the samples pooled) while no form wins by NOISE or more."""
    samples: dict[str, list[float]] = {form: [] for form in runs}
    for _ in range(MAX_ROUNDS):
        for _ in range(REPEATS):
            for form, run in runs.items():
                t0 = time.perf_counter()
                run()
                samples[form].append(time.perf_counter() - t0)
        ms = {form: 1000 * statistics.median(s) / share for form, s in samples.items()}
        if margin_of(ms) >= NOISE:
            break
    return ms


def _weights(
    weights: list[TensorSpec], fp8_block: tuple[int, ...] | None, max_bytes: float
) -> tuple[float, list[torch.Tensor], int]:
    """Random tensors of the weights' shapes: every weight once, or a `max_bytes` share of
    each shape (the share, so the time can be scaled back to the whole graph)."""
    total = sum(spec_bytes(w) for w in weights)
    share = min(1.0, max_bytes / total)
    counts = Counter((w.shape, w.dtype) for w in weights if not w.name.endswith(".scale"))
    scales = {
        (w.shape, w.dtype): s
        for w, s in zip(weights, weights[1:], strict=False)
        if s.name == w.name + ".scale"
    }
    gen = torch.Generator().manual_seed(0)
    flat: list[torch.Tensor] = []
    taken = 0
    for (shape, dtype), count in counts.items():
        for _ in range(max(1, round(count * share))):
            flat.append((torch.randn(shape, generator=gen) * 0.05).to(getattr(torch, dtype)))
            if dtype == FP8:
                flat.append(torch.rand(scales[shape, dtype].shape, generator=gen) + 0.5)
            taken += math.prod(shape) * DTYPE_BYTES[dtype]
    k_block = fp8_block[1] if fp8_block else 0
    weight_total = sum(math.prod(s) * DTYPE_BYTES[d] * c for (s, d), c in counts.items())
    return taken / weight_total, flat, k_block


def _unflatten(flat: list[torch.Tensor], k_block: int) -> list[torch.Tensor | BlockedFp8]:
    out: list[torch.Tensor | BlockedFp8] = []
    i = 0
    while i < len(flat):
        if flat[i].dtype == torch.float8_e4m3fn:
            out.append(BlockedFp8.of(flat[i], flat[i + 1], k_block))
            i += 2
        else:
            out.append(flat[i])
            i += 1
    return out


def _in_features(w: torch.Tensor | BlockedFp8) -> int:
    return (w.weight if isinstance(w, BlockedFp8) else w).shape[1]


def _compiled(
    policy: ProjectionPolicy, xs: dict[int, torch.Tensor], flat: list[torch.Tensor], k_block: int
) -> Callable[[], object]:
    """The projections under `policy`, compiled by Inductor as a graph compiles them."""
    keys = sorted(xs)

    def projections(*args: torch.Tensor) -> list[torch.Tensor]:
        x_by_k = dict(zip(keys, args[: len(keys)], strict=True))
        return [
            project(x_by_k[_in_features(w)], w, policy)
            for w in _unflatten(list(args[len(keys) :]), k_block)
        ]

    fn = torch.compile(projections, fullgraph=True, dynamic=False)
    args = [xs[k] for k in keys] + flat
    return lambda: fn(*args)
