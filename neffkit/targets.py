"""Names shared by the manifest and the compiler: targets, chips, number formats, audit rule ids.

A leaf: imports nothing from neffkit. `manifest` validates against these lists and `compile`
implements them, so neither has to import the other to know what exists; a test checks that the
registries in `compile/` (backends, audit rules) hold exactly these names.
"""

from __future__ import annotations

TARGETS = ("cpu", "cuda", "neuron")
NEURON_TARGETS = ("trn1", "trn2", "trn3")
DTYPES = ("float32", "bfloat16", "float16")
# bytes per element of the tensor dtypes graphs and bundles hold (torch's spellings)
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "bool": 1,
    "float8_e4m3fn": 1,
    "uint8": 1,
    "int8": 1,
}
# fp8 (float8_e4m3fn): its largest finite value is 448. trn1/trn2 have no OCP e4m3fn (neuronx-cc
# NCC_EVRF051: https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/EVRF051.html);
# with --experimental-unsafe-fp8e4m3fn-as-fp8e4m3 the compiler reads e4m3fn bits as IEEE-style
# e4m3, which agree up to 240 (its largest finite value), so there every fp8 value must stay
# within ±240 (docs/neuron.md#fp8-on-trainium). trn3 has e4m3fn.
E4M3FN_MAX = 448.0
E4M3_MAX = 240.0
FP8_AS_E4M3_CHIPS = ("trn1", "trn2")
FP8_AS_E4M3_FLAG = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


def fp8_max(target: str, neuron_target: str | None) -> float:
    """The largest magnitude an fp8 value may hold on this target."""
    if target == "neuron" and neuron_target in FP8_AS_E4M3_CHIPS:
        return E4M3_MAX
    return E4M3FN_MAX


PHASES = ("prefill", "decode", "verify")
# the hazard audit's rules (audit/rules.RULES), in id order; a manifest may waive any of them
AUDIT_RULE_IDS = (
    "NK101",
    "NK102",
    "NK103",
    "NK104",
    "NK105",
    "NK106",
    "NK107",
    "NK108",
    "NK109",
    "NK201",
    "NK202",
    "NK203",
    "NK204",
    "NK205",
    "NK301",
    "NK302",
    "NK303",
    "NK304",
    "NK305",
)
