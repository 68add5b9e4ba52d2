"""Every audit rule with a small graph or manifest that triggers it and one that does not."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from neffkit.audit.checks import audit_buckets, audit_graph
from neffkit.audit.graph import GraphFacts
from neffkit.compile.trace import canonical_text, ensure_fake_process_group, io_alias_map
from neffkit.contract.records import IoAlias
from tests.support.cli import run_cli


def facts_of(
    module, inputs, names, *, target="cpu", phase="decode", flags=(), origins=None, neuron=None
) -> GraphFacts:
    """Export a small module the way neffkit does and describe it for the rules."""
    program = torch.export.export(module, inputs, strict=False).run_decompositions({})
    return GraphFacts(
        name="g",
        phase=phase,
        text=canonical_text(program, names),
        io_alias=io_alias_map(program, names),
        flags=tuple(flags),
        flag_origins=origins or {},
        target=target,
        neuron_target=neuron,
    )


def text_facts(lines: list[str], **kw) -> GraphFacts:
    """A small graph written directly in canonical text, for hazards export cannot produce."""
    return GraphFacts(
        name="g",
        phase=kw.pop("phase", "decode"),
        text="\n".join(lines) + "\n",
        io_alias=kw.pop("io_alias", ()),
        flags=tuple(kw.pop("flags", ())),
        flag_origins=kw.pop("origins", {}),
        target=kw.pop("target", "cpu"),
        neuron_target=kw.pop("neuron", None),
    )


def rules(facts: GraphFacts) -> list[str]:
    return [f.rule for f in audit_graph(facts)]


class KVWrite(torch.nn.Module):
    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.clamp = clamp

    def forward(self, slot_mapping, k_cache, k):
        slots = slot_mapping.clamp(min=0) if self.clamp else slot_mapping
        k_cache.index_put_((slots // 4, slots % 4), k)
        return k.sum(-1)


def test_nk101_unclamped_kv_write():
    args = (torch.tensor([5, -1]), torch.zeros(3, 4, 2), torch.ones(2, 2))
    names = ["slot_mapping", "k_cache.0", "k"]
    assert rules(facts_of(KVWrite(clamp=False), args, names)) == ["NK101"]
    assert rules(facts_of(KVWrite(clamp=True), args, names)) == []


class Embed(torch.nn.Module):
    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.clamp = clamp

    def forward(self, input_ids, table):
        ids = input_ids.clamp(0, table.shape[0] - 1) if self.clamp else input_ids
        return table[ids].sum(-1)


def test_nk109_unclamped_embedding_gather():
    args = (torch.tensor([[3, 99999]]), torch.ones(8, 4))
    names = ["input_ids", "model.embed_tokens.weight"]
    assert rules(facts_of(Embed(clamp=False), args, names)) == ["NK109"]
    assert rules(facts_of(Embed(clamp=True), args, names)) == []


@pytest.fixture()
def fake_pg():
    ensure_fake_process_group(0, 2)
    yield
    dist.destroy_process_group()


class Reduce(torch.nn.Module):
    def __init__(self, direct: bool, returned: bool) -> None:
        super().__init__()
        self.direct, self.returned = direct, returned

    def forward(self, x):
        from torch.distributed import _functional_collectives as fc

        y = fc.all_reduce(x if self.direct else x * 2, "sum", dist.group.WORLD)
        return y if self.returned else y + x


def test_nk102_collective_reads_graph_input(fake_pg):
    x = (torch.ones(4, 8),)
    assert rules(facts_of(Reduce(direct=True, returned=False), x, ["x"])) == ["NK102"]
    neuron = facts_of(Reduce(direct=True, returned=False), x, ["x"], target="neuron")
    assert [f.severity for f in audit_graph(neuron) if f.rule == "NK102"] == ["error"]
    assert rules(facts_of(Reduce(direct=False, returned=False), x, ["x"])) == []


def test_nk107_collective_result_returned(fake_pg):
    x = (torch.ones(4, 8),)
    assert rules(facts_of(Reduce(direct=False, returned=True), x, ["x"])) == ["NK107"]
    assert rules(facts_of(Reduce(direct=False, returned=False), x, ["x"])) == []


def test_nk103_host_read():
    hit = ["%0 = input x : float32[4]", "%1 = aten._local_scalar_dense.default(%0) : float32[]"]
    assert rules(text_facts(hit)) == ["NK103"]
    assert (
        rules(text_facts(["%0 = input x : float32[4]", "%1 = aten.sum.default(%0) : float32[]"]))
        == []
    )


def test_nk104_aliased_mutations():
    lines = [
        "%0 = input k_cache.0 : float32[4, 4]",
        "%1 = aten.as_strided.default(%0, [2, 4], [4, 1]) : float32[2, 4]",
    ]
    assert rules(text_facts(lines)) == ["NK104"]
    # an identity as_strided of a computed value (models/projection.materialized) aliases nothing
    computed = [
        lines[0],
        "%1 = aten.mul.Tensor(%0, 2) : float32[4, 4]",
        "%2 = aten.view.default(%1, [16]) : float32[16]",
        "%3 = aten.as_strided.default(%2, [16], [1]) : float32[16]",
    ]
    assert rules(text_facts(computed)) == []
    via_view = [
        lines[0],
        "%1 = aten.view.default(%0, [16]) : float32[16]",
        "%2 = aten.as_strided.default(%1, [8], [2]) : float32[8]",
    ]
    assert rules(text_facts(via_view)) == ["NK104"]
    twice = (IoAlias("k_cache.0", 0), IoAlias("k_cache.0", 1))
    assert rules(text_facts(lines[:1], io_alias=twice)) == ["NK104"]
    assert rules(text_facts(lines[:1], io_alias=twice[:1])) == []


def test_nk105_input_over_2_pow_32_bytes():
    big = ["%0 = input k_cache.0 : float32[1048576, 1024]"]  # 4 GiB
    assert rules(text_facts(big)) == ["NK105"]
    assert rules(text_facts(["%0 = input k_cache.0 : float32[1024, 1024]"])) == []


class MaskAnd(torch.nn.Module):
    def forward(self, a, b):
        return (a & b).sum()


def test_nk106_broadcast_bool_and():
    big, row = torch.ones(256, 512, dtype=torch.bool), torch.ones(1, 512, dtype=torch.bool)
    assert rules(facts_of(MaskAnd(), (big, row), ["a", "b"])) == ["NK106"]
    words, lanes = torch.ones(256, 512, 1, dtype=torch.int32), torch.ones(32, dtype=torch.int32)
    assert rules(facts_of(MaskAnd(), (words, lanes), ["a", "b"])) == []  # a bit test
    assert rules(facts_of(MaskAnd(), (big, big), ["a", "b"])) == []


def test_nk108_all_to_all_on_trn2():
    lines = [
        "%0 = input x : float32[8]",
        "%1 = aten.mul.Tensor(%0, 2) : float32[8]",
        "%2 = _c10d_functional.all_to_all_single.default(%1, [4, 4], [4, 4], '0') : float32[8]",
    ]
    trn2 = text_facts(lines, target="neuron", neuron="trn2", flags=["-O3"])
    assert rules(trn2) == ["NK108"]
    assert rules(text_facts(lines, target="neuron", neuron="trn3", flags=["-O3"])) == []


def test_nk201_prefill_bucket_multiple_of_128():
    assert [f.rule for f in audit_buckets("neuron", [96, 128])] == ["NK201"]
    assert audit_buckets("neuron", [128, 256]) == [] and audit_buckets("cpu", [96]) == []


FP8 = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


H2T = "--internal-hlo2tensorizer-options=--modular-flow-mac-threshold=10"


def test_nk202_fp8_on_trn2_needs_the_flag():
    lines = ["%0 = input k_cache.0 : float8_e4m3fn[4, 4]"]
    assert rules(text_facts(lines, target="neuron", neuron="trn2", flags=[H2T])) == ["NK202"]
    assert rules(text_facts(lines, target="neuron", neuron="trn1", flags=[H2T])) == ["NK202"]
    ok = [f"{H2T} {FP8}"]
    assert rules(text_facts(lines, target="neuron", neuron="trn2", flags=ok)) == []
    assert rules(text_facts(lines, target="neuron", neuron="trn3", flags=[H2T])) == []


def _fp8_cast(clamp: str) -> list[str]:
    return [
        "%0 = input k : float32[4, 4]",
        f"%1 = {clamp} : float32[4, 4]",
        "%2 = aten._to_copy.default(%1) {dtype: torch.float8_e4m3fn} : float8_e4m3fn[4, 4]",
    ]


@pytest.mark.parametrize(
    ("clamp", "fires"),
    [
        ("aten.clamp.default(%0, -240.0, 240.0)", False),
        ("aten.clamp.default(%0, -200, 200)", False),
        ("aten.clamp.default(%0, -448.0, 448.0)", True),  # the e4m3fn range: past e4m3's
        ("aten.clamp.default(%0, -240.0)", True),  # one-sided
        ("aten.mul.Tensor(%0, 2.0)", True),  # no clamp at all
    ],
)
def test_nk202_fp8_cast_on_trn2_must_read_a_240_clamp(clamp: str, fires: bool):
    ok = [f"{H2T} {FP8}"]
    found = rules(text_facts(_fp8_cast(clamp), target="neuron", neuron="trn2", flags=ok))
    assert found == (["NK202"] if fires else [])
    # trn3 has e4m3fn (448): the cast rule is trn1/trn2's
    assert rules(text_facts(_fp8_cast(clamp), target="neuron", neuron="trn3", flags=[H2T])) == []


def test_nk203_one_hlo2tensorizer_string():
    two = ["--internal-hlo2tensorizer-options=--a", "--internal-hlo2tensorizer-options=--b"]
    assert rules(text_facts([], target="neuron", flags=two)) == ["NK203"]
    assert rules(text_facts([], target="neuron", flags=two[:1])) == []


def test_nk204_model_type_override():
    flags = ["--model-type=generic"]
    assert rules(text_facts([], target="neuron", flags=flags, origins={flags[0]: "rule 0"})) == [
        "NK204"
    ]
    assert rules(text_facts([], target="neuron", flags=flags, origins={flags[0]: "base"})) == []


def test_nk205_decode_collectives_below_o3():
    lines = [
        "%0 = input x : float32[8]",
        "%1 = aten.mul.Tensor(%0, 2) : float32[8]",
        "%2 = _c10d_functional.all_reduce.default(%1, 'sum', '0') : float32[8]",
    ]
    assert rules(text_facts(lines, target="neuron", flags=["-O2"])) == ["NK205"]
    assert rules(text_facts(lines, target="neuron", flags=["-O3"])) == []
    assert rules(text_facts(lines, target="neuron", phase="prefill", flags=["-O2"])) == []


def test_inspect_manifest_without_building(tmp_path, hf_model_dir):
    import yaml

    data = {
        "neffkit": 1,
        "model": str(hf_model_dir("llama")),
        "target": "neuron",
        "parallel": {"tp": 2},
        "buckets": {"prefill": [64], "decode": [1], "context": [128]},
        "compiler": {"flags": ["--model-type=generic"]},
    }
    path = tmp_path / "n.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run_cli("inspect", str(path), "--json")
    report = json.loads(proc.stdout)
    assert {f["rule"] for f in report["findings"]} == {"NK201", "NK204", "NK205"}
    assert proc.returncode == 0  # warnings only


def test_inspect_manifest_says_what_it_checked_and_that_nothing_was_found(tmp_path, hf_model_dir):
    """A clean manifest prints "no findings" with the rules, buckets, graphs and flags it
    checked, never an empty table."""
    import yaml

    data = {
        "neffkit": 1,
        "model": str(hf_model_dir("llama")),
        "buckets": {"prefill": [16], "decode": [1, 4], "context": [64]},
    }
    path = tmp_path / "clean.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    lines = [line.strip() for line in proc.stdout.splitlines()]
    assert lines[-1] == "no findings", proc.stdout
    assert "rules     NK201, NK202, NK203, NK204, NK205" in proc.stdout
    assert "buckets   prefill [16], decode [1, 4], context [64]" in proc.stdout
    assert "graphs    3: prefill_t16_c64, decode_b1_c64, decode_b4_c64" in proc.stdout
    report = json.loads(run_cli("inspect", str(path), "--json").stdout)
    assert report["findings"] == [] and report["checked"]["rules"][0] == "NK201"


# ---------------------------------------------------------------- rules on the HLO module (NK30x)


def _hlo(*body: str) -> str:
    """A small HLO module in text form: ENTRY with the given instructions."""
    lines = [
        "HloModule main",
        "",
        "region_add {",
        "  a = f32[] parameter(0)",
        "  b = f32[] parameter(1)",
        "  ROOT s = f32[] add(a, b)",
        "}",
        "",
        "ENTRY main {",
        *(f"  {line}" for line in body),
        "}",
    ]
    return "\n".join(lines) + "\n"


def hlo_rules(text: str) -> list[str]:
    facts = GraphFacts(
        name="g",
        phase="decode",
        text="",
        io_alias=(),
        flags=(),
        flag_origins={},
        target="neuron",
        neuron_target="trn2",
        hlo_text=text,
    )
    return [f.rule for f in audit_graph(facts) if f.rule.startswith("NK30")]


@pytest.mark.parametrize(
    ("body", "fires"),
    [
        # NK301: f64 anywhere (here the floor division torch lowered through float64)
        (
            [
                "p = s64[1]{0} parameter(0)",
                "c = f64[1]{0} convert(p)",
                "ROOT f = f64[1]{0} floor(c)",
            ],
            ["NK301"],
        ),
        (["p = s64[1]{0} parameter(0)", "ROOT c = f32[1]{0} convert(p)"], []),
        # NK302: a collective straight on a parameter, or on an intermediate
        (
            [
                "p = f32[4]{0} parameter(0)",
                "ROOT r = f32[4]{0} all-reduce(p), replica_groups={{0,1}}, to_apply=region_add",
            ],
            ["NK302"],
        ),
        (
            [
                "p = f32[4]{0} parameter(0)",
                "m = f32[4]{0} multiply(p, p)",
                "ROOT r = f32[4]{0} all-reduce(m), replica_groups={{0,1}}, to_apply=region_add",
            ],
            [],
        ),
        # NK303: gather indices from a parameter, unclamped / clamped / from an argmax's iota
        (
            [
                "t = f32[8,4]{1,0} parameter(0)",
                "i = s64[2,1]{1,0} parameter(1)",
                "ROOT g = f32[2,4]{1,0} gather(t, i), offset_dims={1}, collapsed_slice_dims={0}, "
                "start_index_map={0}, index_vector_dim=1, slice_sizes={1,4}",
            ],
            ["NK303"],
        ),
        (
            [
                "t = f32[8,4]{1,0} parameter(0)",
                "i = s64[2,1]{1,0} parameter(1)",
                "lo = s64[] constant(0)",
                "hi = s64[] constant(7)",
                "c = s64[2,1]{1,0} clamp(lo, i, hi)",
                "ROOT g = f32[2,4]{1,0} gather(t, c), offset_dims={1}, collapsed_slice_dims={0}, "
                "start_index_map={0}, index_vector_dim=1, slice_sizes={1,4}",
            ],
            [],
        ),
        (
            [
                "t = f32[8,4]{1,0} parameter(0)",
                "v = f32[2,8]{1,0} parameter(1)",
                "io = s64[2,8]{1,0} iota(), iota_dimension=1",
                "s = (f32[2,8]{1,0}, s64[2,8]{1,0}) sort(v, io), dimensions={1}, "
                "to_apply=region_add",
                "k = s64[2,8]{1,0} get-tuple-element(s), index=1",
                "r = s64[2,1]{1,0} slice(k), slice={[0:2], [0:1]}",
                "ROOT g = f32[2,4]{1,0} gather(t, r), offset_dims={1}, collapsed_slice_dims={0}, "
                "start_index_map={0}, index_vector_dim=1, slice_sizes={1,4}",
            ],
            [],
        ),
        # NK304: a value of 2**32 elements
        (["ROOT p = bf16[65536,65536]{1,0} parameter(0)"], ["NK304"]),
        (["ROOT p = bf16[65536,65535]{1,0} parameter(0)"], []),
    ],
)
def test_hlo_rules_fire_on_the_hazard_and_not_beside_it(body: list[str], fires: list[str]):
    assert [r for r in hlo_rules(_hlo(*body)) if r != "NK305"] == fires


def test_nk305_names_opcodes_missing_from_the_documented_list():
    text = _hlo(
        "a = u32[4]{0} parameter(0)",
        "b = u32[4]{0} parameter(1)",
        "x = u32[4]{0} xor(a, b)",
        "ROOT y = u32[4]{0} or(x, b)",
    )
    facts = GraphFacts(
        name="g",
        phase="decode",
        text="",
        io_alias=(),
        flags=(),
        flag_origins={},
        target="neuron",
        neuron_target="trn2",
        hlo_text=text,
    )
    (finding,) = audit_graph(facts)
    assert finding.rule == "NK305" and finding.severity == "info"
    assert finding.message.endswith(": or, xor")
    assert hlo_rules(_hlo("a = f32[4]{0} parameter(0)", "ROOT b = f32[4]{0} add(a, a)")) == []
