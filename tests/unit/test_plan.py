"""Plan: graph names, bucket pairing and rule matching. Pure Python."""

from __future__ import annotations

import subprocess
import sys

from neffkit.compile.units import GraphSpec
from neffkit.contract.abi import GraphKey, Phase


def test_graph_names():
    assert GraphKey(Phase.PREFILL, 1, 128, 1024).name == "prefill_t128_c1024"
    assert GraphKey(Phase.DECODE, 4, 1, 1024).name == "decode_b4_c1024"
    assert GraphKey(Phase.PREFILL, 4, 128, 1024).name == "prefill_b4_t128_c1024"
    assert GraphKey(Phase.VERIFY, 4, 1 + 3, 1024).name == "verify_b4_k3_c1024"
    # a phase read back from bundle.json (a plain string) finds the same graph
    assert GraphKey("decode", 4, 1, 1024) == GraphKey(Phase.DECODE, 4, 1, 1024)
    assert {GraphKey(Phase.DECODE, 4, 1, 1024): 1}[GraphKey("decode", 4, 1, 1024)] == 1


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
