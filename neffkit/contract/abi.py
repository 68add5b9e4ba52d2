"""The graph ABI: every graph's inputs and outputs by name, order and dtype, and the slot rule.

models/ builds graphs that take exactly these inputs in this order, the runtime fills them,
`build --verify` makes representative ones, and bundle.json records them per graph (the names
appear in the io-alias map). One place, so the three cannot drift. Imports only the contract's
KV groups, and no torch.

Input order: metadata (built on the host), `rank` where graphs need it, the KV cache (one tensor
per layer and kind), the device-resident decode state, the adapter slots (bundles with `lora:`),
then the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from neffkit.contract.kv_groups import group_input

# ---------------------------------------------------------------------------------- names
INPUT_IDS = "input_ids"  # [lines, T] token ids (decode with device state: none)
POSITIONS = "positions"  # [lines, T] each token's position in its sequence
SLOT_MAPPING = "slot_mapping"  # [lines, T] each token's KV slot; -1 pads (the null block)
BLOCK_TABLES = "block_tables"  # [B, C / block_size] each row's blocks; -1 past the valid ones
CONTEXT_LENS = "context_lens"  # [B] tokens each row attends to; 0 pads
SEQ_IDS = "seq_ids"  # [1, T] packed prefill: each token's sequence
LAST_TOKEN_INDEX = "last_token_index"  # [B] prefill: each sequence's last token in the row
SEQ_SLOTS = "seq_slots"  # [B] device state: each row's slot in `last_tokens`; 0 pads
TARGET_IDS = "target_ids"  # [B, T] prompt logprobs: the token after each position
# [lines, T, hidden] float32 (DeepSeek MTP): the hidden state each position's prediction starts
# from (the target's last layer's output there, or the MTP layer's own at a recurrent step)
PREVIOUS_HIDDEN = "previous_hidden"
TEMPERATURE, TOP_K, TOP_P, SEED = "temperature", "top_k", "top_p", "seed"  # [B] each row's
SAMPLING_INPUTS = (
    (TEMPERATURE, "float32"),
    (TOP_K, "int64"),
    (TOP_P, "float32"),
    (SEED, "int64"),
)
SAMPLING_NAMES = tuple(name for name, _ in SAMPLING_INPUTS)
# what a request does to the logits before sampling (kernels/logits.py), where the bundle has it:
# a grammar's allowed tokens, [B, ceil(V/32)] (verify: [B, T, ceil(V/32)]), bit v % 32 of word
# v // 32 (vLLM's and xgrammar's layout; sampling.structured)
TOKEN_BITMASK = "token_bitmask"
# [B, P] each row's distinct prompt and output tokens (-1 pads) and how often each occurs in the
# output, and the three penalties [B] (sampling.max_penalty_tokens: P)
PENALTY_IDS, PENALTY_COUNTS = "penalty_ids", "penalty_counts"
PENALTY_NAMES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# [B, L] logit_bias pairs (-1 pads), min_tokens' stop tokens at -inf (sampling.max_logit_bias)
BIAS_IDS, BIAS_VALUES = "bias_ids", "bias_values"
LOGIT_INPUTS = (TOKEN_BITMASK, PENALTY_IDS, PENALTY_COUNTS, *PENALTY_NAMES, BIAS_IDS, BIAS_VALUES)
RANK = "rank"  # [1] int64: this graph's rank, as data (one artifact serves every rank)
LAST_TOKENS = "last_tokens"  # [num_blocks] int64: each sequence's last sampled token
# [B] int64, bundles with `lora:`: each row's adapter slot, 1 .. max_loras; 0 (and padding): the
# base model. The slot tensors follow the decode state (contract/lora.py)
LORA_SLOTS = "lora_slots"

NEXT_TOKENS = "next_tokens"
NUM_EMITTED = "num_emitted"  # [B] verify: tokens each row emits (accepted drafts + 1)
# float32, the last layer's output before the final norm (speculation.method mtp): decode [B, H],
# verify [B, T, H], prefill [T, H] (every position of the packed row)
HIDDEN_STATES = "hidden_states"
# [B, hidden] float32 (embed bundles): each sequence's final states over its tokens in the
# chunk, pooled (models/pooling.py; the host combines a long input's chunks)
POOLED = "pooled"
TOKEN_LOGPROBS = "token_logprobs"
TOP_LOGPROB_IDS = "top_logprob_ids"
TOP_LOGPROBS = "top_logprobs"
PROMPT_LOGPROBS = "prompt_logprobs"
PROMPT_TOP_LOGPROB_IDS = "prompt_top_logprob_ids"
PROMPT_TOP_LOGPROBS = "prompt_top_logprobs"

# what a metadata array holds before the host writes a row into it: padding everywhere (slot -1
# and block -1 land in the null block, top_p 1 keeps the whole vocabulary)
PAD_VALUES: dict[str, float] = {
    SLOT_MAPPING: -1,
    BLOCK_TABLES: -1,
    TOP_P: 1.0,
    TOKEN_BITMASK: -1,  # every token allowed
    PENALTY_IDS: -1,
    "repetition_penalty": 1.0,
    BIAS_IDS: -1,
}


def pad_value(name: str) -> float:
    """What metadata input `name` holds in a padding row (a KV group's tables and slots as the
    first group's)."""
    return PAD_VALUES.get(name.partition(".")[0] if name[-1:].isdigit() else name, 0)


KV_KINDS = {"mha": ("k", "v"), "mla": ("kv",)}  # cache tensors per layer, by cache kind


# ---------------------------------------------------------------------------------- phases
class Phase(str, Enum):
    """A graph's kind. A `str`, so bundle.json, graph names and manifest rules read it as the
    plain name, and a phase read back from a bundle ("decode") equals and hashes as the member."""

    PREFILL = "prefill"  # prompt chunks: `rows` sequences' T tokens packed in one row
    DECODE = "decode"  # `rows` sequences, one token each
    VERIFY = "verify"  # speculation: `rows` sequences of 1 + K tokens, every position sampled

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)

    def __hash__(self) -> int:
        return hash(self.value)


@dataclass(frozen=True)
class PhaseRule:
    """What a phase's graph takes and returns, asked instead of the phase's name (by the plan,
    the models, `build --verify` and the runtime alike)."""

    packed: bool  # every sequence's tokens in one row (per-token sequence ids when rows > 1)
    samples_every_position: bool  # each of a row's T positions sampled (drafts accepted in-graph)
    one_token: bool  # T = 1: a row's next token only (MoE reads the routed experts only)
    host_ids: bool  # input_ids come from the host even with device state (verify: the drafts)
    name: str  # the graph's name; `packed_name` for a packed graph of several rows
    packed_name: str = ""
    bucket: str = "rows"  # what the phase's own bucket counts: "rows" or "tokens"


PHASES: dict[str, PhaseRule] = {  # keyed by the members, which are strs
    Phase.PREFILL: PhaseRule(
        packed=True,
        samples_every_position=False,
        one_token=False,
        host_ids=True,
        name="prefill_t{tokens}_c{context}",
        packed_name="prefill_b{rows}_t{tokens}_c{context}",
        bucket="tokens",
    ),
    Phase.DECODE: PhaseRule(
        packed=False,
        samples_every_position=False,
        one_token=True,
        host_ids=False,
        name="decode_b{rows}_c{context}",
    ),
    Phase.VERIFY: PhaseRule(
        packed=False,
        samples_every_position=True,
        one_token=False,
        host_ids=True,
        name="verify_b{rows}_k{drafts}_c{context}",
    ),
}


@dataclass(frozen=True)
class GraphKey:
    """One graph's identity: its phase and static dims (rows, tokens per row, context). The
    runtime finds a graph by it; the build names the graph by it."""

    phase: Phase
    rows: int
    tokens: int
    context: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))  # a name read from a bundle

    @property
    def rule(self) -> PhaseRule:
        return PHASES[self.phase]

    @property
    def name(self) -> str:
        """`prefill_t128_c1024`, `prefill_b4_t128_c1024`, `decode_b4_c1024`,
        `verify_b4_k3_c1024`."""
        rule = self.rule
        form = rule.packed_name if rule.packed and self.rows > 1 else rule.name
        return form.format(
            rows=self.rows, tokens=self.tokens, drafts=self.tokens - 1, context=self.context
        )


# ---------------------------------------------------------------------------------- the slot rule
def slot(block: Any, position: Any, block_size: int) -> Any:
    """The KV slot of `position` in its `block` (ints or numpy arrays): block * size + offset."""
    return block * block_size + position % block_size


def slots_of(blocks: Any, positions: Any, block_size: int) -> Any:
    """Each position's slot given a sequence's block list (numpy: `blocks[positions // bs]`)."""
    return slot(blocks[positions // block_size], positions, block_size)


# ---------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class GraphShape:
    """Static shape of one graph: B rows of T tokens attending to at most C context tokens."""

    # prefill: T tokens of `rows` sequences packed in one row (rows > 1: per-token sequence ids);
    # decode: `rows` sequences, one token each; verify: `rows` sequences of 1 + K tokens, the last
    # sampled token and K drafts, the drafts accepted in the graph (PHASES: what each takes)
    phase: Phase
    rows: int
    tokens: int
    context: int
    block_size: int
    num_blocks: int
    logprobs: int = 5  # top logprobs per sampled token (the manifest's sampling.max_logprobs)
    prompt_logprobs: bool = False  # prefill also returns each prompt token's logprobs
    # decode reads each row's token from the `last_tokens` state (manifest decode_state: device)
    device_state: bool = False
    # width of the `hidden_states` output (the target of MTP speculation, and the MTP layer), or
    # of the `pooled` one (embed bundles); 0: none
    hidden_out: int = 0
    # width of the `previous_hidden` input (the MTP layer's graphs); 0: none
    hidden_in: int = 0
    # logit inputs (kernels/logits.py; 0: none): bitmask words, penalty and logit-bias pairs
    bitmask_words: int = 0
    penalty_tokens: int = 0
    bias_tokens: int = 0
    adapters: bool = False  # takes `lora_slots` (the bundle has adapter slots)
    # KV groups (kv_groups.py): each group's pool and each layer's group; empty: one group
    group_blocks: tuple[int, ...] = ()
    layer_group: tuple[int, ...] = ()
    # embed bundles: "last", "mean" or "cls", `pooled` returned and nothing sampled; "": none
    pooling: str = ""

    @property
    def rule(self) -> PhaseRule:
        return PHASES[self.phase]

    def layer_blocks(self, layer: int) -> int:
        """The pool of layer `layer`'s KV group: its cache tensors' first dimension."""
        if not self.group_blocks:
            return self.num_blocks
        return self.group_blocks[self.layer_group[layer]]

    @property
    def packed(self) -> bool:
        """Several sequences' tokens in one row (per-token sequence ids)."""
        return self.rule.packed and self.rows > 1

    @property
    def lines(self) -> int:
        """Rows of tokens the graph takes: one packed row, or one per sequence."""
        return 1 if self.rule.packed else self.rows


def metadata_inputs(shape: GraphShape) -> list[TensorSpec]:
    """The host-built inputs, in order. With device state a decode graph takes no input_ids:
    `seq_slots` (each row's sequence's slot in `last_tokens`; 0 pads) says where its token is,
    and prefill takes `seq_slots` too, to store each sequence's sampled token there. Each KV
    group after the first (contract/kv_groups.py) has its own slot mapping and block tables."""
    b, t, lines, rule = shape.rows, shape.tokens, shape.lines, shape.rule
    host_ids = rule.host_ids or not shape.device_state  # verify: drafts from the host
    specs = [TensorSpec(INPUT_IDS, (lines, t), "int64")] if host_ids else []
    specs.append(TensorSpec(POSITIONS, (lines, t), "int64"))
    for g in range(max(1, len(shape.group_blocks))):
        specs += [
            TensorSpec(group_input(SLOT_MAPPING, g), (lines, t), "int64"),
            TensorSpec(
                group_input(BLOCK_TABLES, g), (b, shape.context // shape.block_size), "int64"
            ),
        ]
    specs.append(TensorSpec(CONTEXT_LENS, (b,), "int64"))
    if shape.packed:
        specs.append(TensorSpec(SEQ_IDS, (1, t), "int64"))
    if rule.packed:
        specs.append(TensorSpec(LAST_TOKEN_INDEX, (b,), "int64"))
    if shape.device_state:
        specs.append(TensorSpec(SEQ_SLOTS, (b,), "int64"))
    if shape.pooling:  # pooled hidden states: nothing sampled
        return specs
    specs += [TensorSpec(name, (b,), dtype) for name, dtype in SAMPLING_INPUTS]
    specs += logit_inputs(shape)
    if rule.packed and shape.prompt_logprobs:
        specs.append(TensorSpec(TARGET_IDS, (b, t), "int64"))
    if shape.hidden_in:
        specs.append(TensorSpec(PREVIOUS_HIDDEN, (lines, t, shape.hidden_in), "float32"))
    if shape.adapters:
        specs.append(TensorSpec(LORA_SLOTS, (b,), "int64"))
    return specs


def logit_inputs(shape: GraphShape) -> list[TensorSpec]:
    """The logit-processing inputs the shape has, in order (after the sampling values)."""
    b, specs = shape.rows, []
    if shape.bitmask_words:
        lead = (b, shape.tokens) if shape.rule.samples_every_position else (b,)
        specs.append(TensorSpec(TOKEN_BITMASK, (*lead, shape.bitmask_words), "int32"))
    if shape.penalty_tokens:
        p = shape.penalty_tokens
        specs += [
            TensorSpec(PENALTY_IDS, (b, p), "int64"),
            TensorSpec(PENALTY_COUNTS, (b, p), "float32"),
        ]
        specs += [TensorSpec(name, (b,), "float32") for name in PENALTY_NAMES]
    if shape.bias_tokens:
        specs += [
            TensorSpec(BIAS_IDS, (b, shape.bias_tokens), "int64"),
            TensorSpec(BIAS_VALUES, (b, shape.bias_tokens), "float32"),
        ]
    return specs


def graph_outputs(shape: GraphShape) -> list[TensorSpec]:
    """The user outputs, in order (the K/V mutations precede them in an exported program)."""
    if shape.pooling:
        return [TensorSpec(POOLED, (shape.rows, shape.hidden_out), "float32")]
    specs = _sampled_outputs(shape)
    if shape.hidden_out:
        specs.append(TensorSpec(HIDDEN_STATES, (*hidden_lead(shape), shape.hidden_out), "float32"))
    return specs


def hidden_lead(shape: GraphShape) -> tuple[int, ...]:
    """The `hidden_states` output's leading dims: every position of the packed row [T], every
    position of each row [B, T] (verify), or each row's one [B]."""
    if shape.rule.packed:
        return (shape.tokens,)
    return (shape.rows, shape.tokens) if shape.rule.samples_every_position else (shape.rows,)


def _sampled_outputs(shape: GraphShape) -> list[TensorSpec]:
    b, n = shape.rows, shape.logprobs
    if shape.rule.samples_every_position:  # per position, the emitted ones first in each row
        t = shape.tokens
        return [
            TensorSpec(NEXT_TOKENS, (b, t), "int64"),
            TensorSpec(NUM_EMITTED, (b,), "int64"),
            TensorSpec(TOKEN_LOGPROBS, (b, t), "float32"),
            TensorSpec(TOP_LOGPROB_IDS, (b, t, n), "int64"),
            TensorSpec(TOP_LOGPROBS, (b, t, n), "float32"),
        ]
    specs = [
        TensorSpec(NEXT_TOKENS, (b,), "int64"),
        TensorSpec(TOKEN_LOGPROBS, (b,), "float32"),
        TensorSpec(TOP_LOGPROB_IDS, (b, n), "int64"),
        TensorSpec(TOP_LOGPROBS, (b, n), "float32"),
    ]
    if shape.rule.packed and shape.prompt_logprobs:
        t = shape.tokens
        specs += [
            TensorSpec(PROMPT_LOGPROBS, (t,), "float32"),
            TensorSpec(PROMPT_TOP_LOGPROB_IDS, (t, n), "int64"),
            TensorSpec(PROMPT_TOP_LOGPROBS, (t, n), "float32"),
        ]
    return specs


def kv_cache_names(num_layers: int, kv_kind: str) -> list[str]:
    """The cache tensors' input names in order: `k_cache.i`, `v_cache.i` per layer (mha) or one
    latent `kv_cache.i` per layer (mla)."""
    return [f"{kind}_cache.{layer}" for layer in range(num_layers) for kind in KV_KINDS[kv_kind]]


def is_kv_cache(name: str) -> bool:
    return name.startswith(tuple(f"{kind}_cache." for kind in ("k", "v", "kv")))


def is_aliased(name: str) -> bool:
    """An input every phase's graph updates in place, so an output aliases it (the io-alias
    map): each KV cache tensor and the device decode state. The map itself is read from the
    exported program, never written by hand; the build checks it against this rule."""
    return is_kv_cache(name) or name == LAST_TOKENS


def kv_inputs(
    shape: GraphShape, num_layers: int, kv_kind: str, kv_heads: int, width: int, dtype: str
) -> list[TensorSpec]:
    """One K and one V tensor per layer, [blocks, block_size, kv_heads, head_dim]; MLA: one
    latent tensor per layer, [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]. `blocks`
    is the layer's KV group's pool (shape.layer_blocks)."""
    per_layer = len(KV_KINDS[kv_kind])
    names = kv_cache_names(num_layers, kv_kind)
    return [
        TensorSpec(
            name, (shape.layer_blocks(i // per_layer), shape.block_size, kv_heads, width), dtype
        )
        for i, name in enumerate(names)
    ]


def state_names(decode_state: str) -> list[str]:
    """The device-resident state tensors (after the caches): `last_tokens[slot]`, the last token
    sampled for the sequence in that slot, aliased like the caches (decode_state: device)."""
    return [LAST_TOKENS] if decode_state == "device" else []


def state_inputs(shape: GraphShape) -> list[TensorSpec]:
    names = state_names("device" if shape.device_state else "host")
    return [TensorSpec(name, (shape.num_blocks,), "int64") for name in names]
