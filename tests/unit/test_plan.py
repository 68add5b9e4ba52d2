"""Plan: graph names, bucket pairing and rule matching. Pure Python."""

from __future__ import annotations

import subprocess
import sys

from neffkit.compile.plan import graph_name
from neffkit.compile.units import GraphSpec


def test_graph_names():
    assert graph_name("prefill", 128, 1024) == "prefill_t128_c1024"
    assert graph_name("decode", 4, 1024) == "decode_b4_c1024"
    assert graph_name("prefill", 128, 1024, rows=4) == "prefill_b4_t128_c1024"


def test_rule_matching():
    spec = GraphSpec("decode_b4_c64", "decode", 4, 1, 64)
    assert spec.matches({"phase": "decode"})
    assert spec.matches({"batch": [2, 8], "context": 64})
    assert not spec.matches({"tokens": 16})
    assert not spec.matches({"phase": "prefill"})
    packed = GraphSpec("prefill_b4_t16_c64", "prefill", 4, 16, 64)
    assert packed.matches({"phase": "prefill", "batch": 4, "tokens": 16})
    assert not packed.matches({"batch": 1})


def test_plan_and_manifest_import_no_torch():
    code = (
        "import sys, neffkit.compile.plan, neffkit.manifest, neffkit.contract.bundle; "
        "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
