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
PHASES = ("prefill", "decode")
# the hazard audit's rules (compile/audit.RULES), in id order; a manifest may waive any of them
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
)
