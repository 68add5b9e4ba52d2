"""The hazard audit's rules: stable ids, titles and one-line fixes (NK1xx on traced graphs, NK2xx on
buckets and flags, NK3xx on the HLO module). `targets.AUDIT_RULE_IDS` lists the same ids (a test
checks), so the manifest can validate `audit.waive` without importing this package.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffkit.contract.records import FindingRecord

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    fix: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in [
        Rule(
            "NK101",
            "KV write with slot indices not clamped before // or %",
            "clamp slot_mapping to >= 0 (the null block) before computing block and offset",
        ),
        Rule(
            "NK102",
            "collective reads a graph input directly (NCC_INLA001)",
            "copy the input into an intermediate tensor before the collective",
        ),
        Rule(
            "NK103",
            "data-dependent host read in the graph (.item(), nonzero, ...)",
            "keep values on device; move host decisions to metadata built with numpy",
        ),
        Rule(
            "NK104",
            "aliased or overlapping mutated inputs (synthetic base, as_strided replay)",
            "allocate one tensor per layer for K and V; never pass views of one buffer",
        ),
        Rule(
            "NK105",
            "input tensor with 2**32 or more elements or bytes (offset truncation)",
            "split the tensor (e.g. per-layer KV caches) so no input reaches 2**32",
        ),
        Rule(
            "NK106",
            "broadcast boolean AND of a large mask with a [1, N] mask (CHRS-985)",
            "fold validity into positions and use a single comparison or where",
        ),
        Rule(
            "NK107",
            "a collective's result is a graph output (deadlocks the next call under gloo)",
            "feed collective results into later ops (e.g. the residual add), never return them",
        ),
        Rule(
            "NK108",
            "all_to_all on trn2 is emulated (all_gather + slice)",
            "prefer an all-reduce formulation (experts computed densely per rank)",
        ),
        Rule(
            "NK109",
            "embedding gather with token ids not clamped to the vocabulary",
            "clamp input_ids to [0, vocab) before the gather: an out-of-range id is an "
            "out-of-bounds DMA on Neuron and a crash on CPU",
        ),
        Rule(
            "NK201",
            "prefill bucket not a multiple of 128 (NCC_INKI016 for NKI attention)",
            "use prefill buckets that are multiples of 128 on neuron",
        ),
        Rule(
            "NK202",
            "fp8 e4m3fn on trn1/trn2: the e4m3fn-as-e4m3 flag and a ±240 clamp before every "
            "fp8 cast (NCC_EVRF051)",
            "add --experimental-unsafe-fp8e4m3fn-as-fp8e4m3 inside the single "
            "--internal-hlo2tensorizer-options string, and clamp(x, -240, 240) right before "
            "each cast to float8_e4m3fn (e4m3 has no values past 240)",
        ),
        Rule(
            "NK203",
            "more than one --internal-hlo2tensorizer-options (neuronx-cc keeps the last)",
            "merge all hlo2tensorizer options into one string (neffkit's flag model does this)",
        ),
        Rule(
            "NK204",
            "an injected --model-type is overridden",
            "check that the override is intended; neuronx-cc keeps the last --model-type",
        ),
        Rule(
            "NK205",
            "decode graph with collectives compiled below -O3 (modular flow wraps each)",
            "compile decode graphs with -O3 (a per_graph rule: {match: {phase: decode}})",
        ),
        Rule(
            "NK301",
            "f64 value in the HLO module (Trainium has no 64-bit floating point)",
            "find the torch op that lowered through float64 (floor division, float() of an "
            "int64) and keep it in integers or float32",
        ),
        Rule(
            "NK302",
            "HLO collective reads an entry parameter (NCC_INLA001)",
            "copy the input into an intermediate tensor before the collective",
        ),
        Rule(
            "NK303",
            "HLO gather/scatter indices reach a parameter without a clamp",
            "clamp indices from the host (token ids, slots, positions, ranks) into range in "
            "the graph: an out-of-range index is an out-of-bounds DMA on Neuron",
        ),
        Rule(
            "NK304",
            "HLO value of 2**32 or more elements (offset truncation)",
            "split the tensor so no value reaches 2**32 elements",
        ),
        Rule(
            "NK305",
            "HLO opcode not in the documented XLA operator list (neuron-cc-ops-xla)",
            "none needed if neuronx-cc accepts it; the list predates neuronx-cc",
        ),
    ]
}


# a finding is stored in bundle.json as it is produced: the record type is the bundle's
Finding = FindingRecord
