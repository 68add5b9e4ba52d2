"""The forms a target chooses for a model's weights and projections, as plain values.

`ProjectionPolicy` says how a graph writes `x @ weight.T` (projection.py has the forms themselves
and why each exists); `Storage` says how the bundle stores the checkpoint's tensors beyond the
tp/ep cut. Both are recorded in the build's layout and bundle.json. Pure Python (no torch): the
build's hand-off types hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffkit.contract import abi

LANES = 16  # one AVX-512 float32 vector: the weight tile the row loop shares


@dataclass(frozen=True)
class ProjectionPolicy:
    """A target's choice of projection forms (compile/backends set it; recorded per graph)."""

    max_rows: int = 0  # rows written as fused reductions; 0 = always `dot` / `mm`
    lanes: int = 0  # projection weights stored blocked [out/lanes, in, lanes]; 0 = plain
    # rows on blocked weights through neffkit::blocked_rows: "off", "on" (every weight) or
    # "auto" (weights of kernel_min_bytes or more; smaller ones stay Inductor's forms)
    kernel: str = "off"
    kernel_min_bytes: int = 1 << 20
    # "auto": the row counts whose graphs (decode, verify, prefill) take the kernel, as the
    # build measured them on its host (compile/autotune.py); None: every row count. At
    # `kernel_all_rows` the kernel takes the weights below kernel_min_bytes too.
    kernel_rows: frozenset[int] | None = None
    kernel_all_rows: frozenset[int] = frozenset()
    # Inductor targets: attention's queries stored once, after RoPE, before the score reduction
    # (see `materialized`: otherwise Inductor inlines RoPE into that reduction and recomputes
    # it for every key; 125M bf16 model, 8 rows: ~0.9 ms of a layer's attention, bench/batch.py)
    buffer_queries: bool = False
    # cpu decode graphs: attention through neffkit::paged_decode_attention, which reads only each
    # row's visible keys from the paged cache (csrc/decode_attention.cpp), instead of gathering,
    # scoring and masking the whole context bucket. Set where the kernel library is in use and
    # the cache holds the compute dtype (not fp8; not MLA's latent cache).
    attention_kernel: bool = False
    # ... and one sequence's prefill too: bf16 builds for a class without a native bf16 matmul
    # (AVX2: oneDNN has none, and ATen's bf16 GEMM is a scalar loop), where the graph's form
    # would cost seconds a prompt (docs/performance.md#cpu-classes)
    prefill_attention_kernel: bool = False
    # cpu decode and verify graphs of bundles with `lora:`: each row's adapter through
    # neffkit::lora_rows (kernels/lora.py), which reads only the slots the rows use
    lora_kernel: bool = False
    # cpu graphs: the sampler skips what no row of a step needs (drawing when every row is
    # greedy, the grammar mask when it allows every token) through torch.cond, and ranks the
    # vocabulary by chunks (kernels/sampling.py); static-graph targets (XLA) run every path
    sampler_branches: bool = False

    def attends_in_kernel(self, phase: str, rows: int) -> bool:
        """Does a graph of this phase and row count attend through the kernel? Decode and verify
        (which must score a position exactly as decode does, or speculation's outputs would move
        with near-ties), and packed prefill (rows > 1), whose form scores every token against
        all the sequences' contexts side by side (S x C keys) where each token sees only its own
        sequence's. One sequence's prefill keeps the graph's form, a GEMM that wins once a token
        sees many keys, unless that GEMM has no fast path (`prefill_attention_kernel`)."""
        packed = abi.PHASES[phase].packed
        alone = packed and rows == 1 and not self.prefill_attention_kernel
        return self.attention_kernel and not alone

    def form(self, rows: int, blocked: bool, weight_bytes: int | None = None) -> str:
        """The form `project` writes for `rows` activation rows and this weight layout
        (`weight_bytes` None: the form of the largest weights)."""
        if blocked:
            if self.max_rows == 0:  # matmuls only (the eager references)
                return "blocked-bmm"
            big = weight_bytes is None or weight_bytes >= self.kernel_min_bytes
            big = big or rows in self.kernel_all_rows
            measured = self.kernel_rows is None or rows in self.kernel_rows
            if self.kernel == "on" or (self.kernel == "auto" and big and measured):
                return "kernel-rows"
            return "blocked-rows" if rows <= self.max_rows else "blocked-bmm"
        if self.max_rows == 0:
            return "dot"
        return "reduction" if rows == 1 else "mm"

    def packed_form(self, rows: int, kernel_reads: bool = False) -> str:
        """The form `project` writes for a weight kept at its storage width (integer / fp4
        codes, intquant.PackedWeight) at `rows` rows, up to `max_rows` of them:
        "kernel-packed" (neffkit::packed_rows, csrc/packed_rows.cpp: where the kernel library
        is in use and reads this weight's layout, `kernel_reads`: packs_to_kernel), else
        "packed-rows" (one fused reduction per row that widens the codes where it reads them,
        each byte once). More rows: the weight widened in the graph and read as a float one
        ("mm"; "dot" where max_rows is 0). Where another CPU int kernel (VNNI, AVX2) would be
        chosen. The kernel is taken under "auto" too: SmolLM2 int4 (groups of 32), batch-1
        decode step, Intel host, 6.6 ms with it against 8.0 in Inductor's form (float32:
        20.7; alternating in one process)."""
        if self.max_rows == 0:
            return "dot"
        if rows > self.max_rows:
            return "mm"
        return "kernel-packed" if kernel_reads and self.kernel != "off" else "packed-rows"

    def int8_form(self, rows: int) -> str:
        """The form `project` writes for a W8A8 weight (intquant.Int8Activations) at `rows`
        rows: "kernel-int8" (neffkit::int8_rows, csrc/int8_rows.cpp: int32 sums) where the
        kernel library is in use, at any row count, else the graph's float32 matmul of the
        integer values ("mm"; "dot" where max_rows is 0), which widens the weight every call:
        SmolLM2's q/k/v on the Intel host, one thread, 0.03 ms against 0.35 at 1 row, 0.16
        against 0.88 at 64 (bench/int8_rows.py)."""
        if self.max_rows == 0:
            return "dot"
        return "kernel-int8" if self.kernel != "off" else "mm"


def packs_to_kernel(bits: int, group: int, in_features: int, weight_only: bool = True) -> bool:
    """Does neffkit::packed_rows read a weight of this layout (float32 compute)? 4- or 8-bit
    codes, weight-only, `in_features` and the group (0: the whole row) multiples of 32 inputs
    (one vector load of 16 code bytes never straddles a group)."""
    group = group or in_features
    return bits in (4, 8) and weight_only and in_features % 32 == 0 and group % 32 == 0


PLAIN = ProjectionPolicy()  # `dot`/`mm` on plain weights: neuron, eager references


def is_projection_weight(name: str) -> bool:
    """Graph weights that reach the graph only through `project` (so may be stored blocked).

    DeepSeek's kv_b_proj is viewed per head and absorbed (einsum), so it stays plain; expert
    weights are graph inputs `moe.gate_up` / `moe.down`, gathered per token (models/moe.py)."""
    if name == "lm_head.weight":
        return True
    return name.endswith("_proj.weight") and not name.endswith("kv_b_proj.weight")


TIED_TABLE = "model.embed_tokens.weight"  # the LM head too, where the embeddings are tied


def takes_projection_form(name: str) -> bool:
    """A weight whose form (kernel or Inductor's) a graph picks: a projection, or the tied
    table as the LM head (stored blocked only where the embeddings are tied, `blocks`)."""
    return is_projection_weight(name) or name == TIED_TABLE


def blocks(name: str, shape: tuple[int, ...], lanes: int, tied: bool = False) -> bool:
    """Is this weight (bundle dtype or fp8) stored blocked under `lanes`? A tied embedding
    table is (the lookup reads it as table[id // lanes, :, id % lanes]), so that the LM head it
    also is takes the blocked forms: its 5-row verify step through `mm` cost twice its 1-row
    reduction (SmolLM2's 49152 x 576 head)."""
    projection = is_projection_weight(name) or (tied and name == TIED_TABLE)
    return lanes > 0 and len(shape) == 2 and shape[0] % lanes == 0 and projection


def blocked_shape(shape: tuple[int, ...], lanes: int) -> tuple[int, ...]:
    out_features, in_features = shape
    return (out_features // lanes, in_features, lanes)


@dataclass(frozen=True)
class Storage:
    """How a bundle stores the checkpoint's tensors, beyond the tp/ep cut."""

    dtype: str  # unquantized tensors' bundle dtype
    # fp8 weights are multiplied by this and their scales divided by it: 240/448 on trn1/trn2,
    # whose fp8 values must stay within ±240 (targets.fp8_max), else 1
    fp8_rescale: float = 1.0
    # the fp8 KV cache reads per-layer k_scale / v_scale graph inputs: the checkpoint's, or
    # (kv_calibrated) measured by the build, one (k, v) pair per layer
    kv_scales: bool = False
    kv_calibrated: tuple[tuple[float, float], ...] | None = None
    # keys stored less a calibrated offset, weighted and rotated before an fp8 cache, queries
    # alike (kv_cache.rotate_keys, kernels/kv.py). Per layer, KV heads x head_dim values each:
    # the mean key before RoPE (k_offsets), the key at position 0 (k_firsts) and each
    # channel's weight (k_smooth); () while the layout is planned, None without rotation
    rotate_keys: bool = False
    k_offsets: tuple[tuple[float, ...], ...] | None = None  # KEY_FORMS below names each input
    k_firsts: tuple[tuple[float, ...], ...] | None = None
    k_smooth: tuple[tuple[float, ...], ...] | None = None
    # projection weights stored blocked [out/lanes, in, lanes] (models/projection.py); 0: plain
    lanes: int = 0
    # fp8 projection weights stored blocked: only where neffkit's kernel may read them (Inductor
    # fuses the widening of a plain fp8 weight into its one-row reduction, not of a blocked one:
    # SmolLM2's projections in Inductor's form, 1 row, 77 ms blocked against 11 in the kernel)
    fp8_lanes: int = 0
    # the LM head quantized to fp8 at build time with the checkpoint's scale blocks (manifest
    # lm_head.dtype); a tied one becomes `lm_head.weight` beside a plain embedding table
    fp8_head: bool = False
    # the manifest's weight quantization of a float checkpoint (checkpoints/requantize.py):
    # "int8" (per output channel) or "int4:<group>", with the weights it leaves in float
    quantize: str = ""
    quantize_exclude: tuple[str, ...] = ()
    # 5- and 6-bit projection codes in groups of a multiple of 32 stored one a byte (an 8-bit
    # scheme, the same values), where neffkit's CPU kernels are in use: they read 4- and 8-bit
    # codes, and Inductor's form widening 5-bit codes is compute-bound (Gemma 3 270M's Q4_K_M
    # file keeps 81 of its 126 projections in Q5_0)
    byte_codes: bool = False

    def table_is_head(self, tied: bool) -> bool:
        """Does the LM head project onto the embedding table itself (so store it blocked)?"""
        return tied and not self.fp8_head


# rotated keys' per-layer graph inputs ([KV, D] each, `model.layers.N.self_attn.<name>`) and the
# Storage field each comes from: the mean key before RoPE, the key at position 0, the weights
KEY_FORMS = {"k_offset": "k_offsets", "k_first": "k_firsts", "k_smooth": "k_smooth"}
