"""The compiler-flag model: each documented rule, origins, and golden neuronx-cc argv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from neffkit.compile.flags import (
    merge_flags,
    neuronx_cc_argv,
    parse_flags,
    resolve_options,
)
from neffkit.compile.plan import make_plan
from neffkit.errors import ManifestError
from neffkit.manifest import load_manifest
from tests.support.models import DEMO_MODEL

GOLDEN = Path(__file__).parents[1] / "golden"
FP8_FLAG = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


def _merged(*layers: tuple[str, list[str]]):
    flags = [f for origin, argv in layers for f in parse_flags(argv, origin)]
    merged, warnings = merge_flags(flags)
    return [f.render() for f in merged], warnings, {f.render(): f.origin for f in merged}


def test_one_opt_level_last_wins():
    rendered, warnings, origins = _merged(("base", ["-O2"]), ("rule 0", ["-O3"]))
    assert rendered == ["-O3"] and origins["-O3"] == "rule 0"
    assert _merged(("base", ["--optlevel", "1"]), ("manifest", ["-O2"]))[0] == ["-O2"]


def test_hlo2tensorizer_options_merge_into_one_string():
    rendered, _, origins = _merged(
        ("base", ["--internal-hlo2tensorizer-options=--modular-flow-mac-threshold=10"]),
        (
            "rule 1",
            ["--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"],
        ),
    )
    assert rendered == [
        "--internal-hlo2tensorizer-options=--modular-flow-mac-threshold=10 "
        "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"
    ]
    assert origins[rendered[0]] == "base+rule 1"


def test_model_type_override_of_injected_value_warns():
    rendered, warnings, _ = _merged(
        ("base", ["--model-type=transformer"]), ("manifest", ["--model-type", "generic"])
    )
    assert rendered == ["--model-type=generic"]
    assert warnings == [
        "--model-type=generic (manifest) overrides the injected --model-type=transformer"
    ]


def test_duplicates_and_conflicts_are_reported():
    _, warnings, _ = _merged(("manifest", ["--auto-cast=none"]), ("rule 0", ["--auto-cast=none"]))
    assert warnings == ["duplicate flag --auto-cast=none (manifest, rule 0)"]
    rendered, warnings, _ = _merged(
        ("manifest", ["--auto-cast=none"]), ("rule 0", ["--auto-cast=matmult"])
    )
    assert rendered == ["--auto-cast=matmult"]
    assert (
        "conflicting flags --auto-cast=none (manifest) and --auto-cast=matmult (rule 0)"
        in (warnings[0])
    )


def test_bad_flags_name_the_field():
    with pytest.raises(ManifestError, match=r"compiler.per_graph\[1\].flags: 'O3' is not a flag"):
        parse_flags(["O3"], "rule 1", "compiler.per_graph[1].flags")
    with pytest.raises(ManifestError, match="optimisation level must be 1, 2 or 3"):
        parse_flags(["-O7"], "manifest", "compiler.flags")


def _neuron_manifest(tmp_path: Path, model_dir: Path) -> Path:
    data = {
        "neffkit": 1,
        "name": "golden",
        "model": str(model_dir),
        "target": "neuron",
        "neuron": {"target": "trn2", "lnc": 2},
        "buckets": {"prefill": [128], "decode": [1, 8], "context": [1024]},
        "compiler": {
            "flags": ["--verbose=info", "--logfile=/tmp/neuron.log"],
            "per_graph": [
                {"match": {"phase": "decode"}, "flags": ["-O3"]},
                {
                    "match": {"phase": "decode", "batch": [4, 8]},
                    "flags": ["--internal-hlo2tensorizer-options=" + FP8_FLAG],
                },
            ],
        },
    }
    path = tmp_path / "golden.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("graph", ["prefill_t128_c1024", "decode_b1_c1024", "decode_b8_c1024"])
def test_golden_neuronx_cc_argv(graph, tmp_path):
    # the demo checkpoint: its max_position_embeddings (2048) holds the 1024-token context bucket
    manifest = load_manifest(_neuron_manifest(tmp_path, DEMO_MODEL))
    spec = next(s for s in make_plan(manifest).graphs if s.name == graph)
    options = resolve_options(manifest, spec)
    argv = neuronx_cc_argv(f"ir/{graph}.hlo.pb", f"graphs/{graph}.neff", "trn2", 2, options.flags)
    golden = json.loads((GOLDEN / f"{graph}.argv.json").read_text())
    assert argv == golden["argv"]
    assert options.flag_origins == golden["origins"]
    assert sum(a.startswith("--internal-hlo2tensorizer-options") for a in argv) == 1
    assert "--logfile=/tmp/neuron.log" in argv
    assert "--logfile=/tmp/neuron.log" not in options.cache_flags()


def _reference() -> dict:
    return json.loads((GOLDEN / "neuronx_cc_reference.json").read_text())


def check_against_reference(argv: list[str]) -> list[str]:
    """Problems with an argv against the CLI reference (documented options, their values) and
    the internal options the reference file records; [] when every flag is accounted for."""
    ref, problems = _reference(), []
    assert argv[:2] == ["neuronx-cc", "compile"] and argv[2].endswith(".hlo.pb"), argv
    i = 3
    while i < len(argv):
        token = argv[i]
        if token.startswith("-O") and not token.startswith("--"):
            name, value = "-O", token[2:]
        elif "=" in token:
            name, value = token.split("=", 1)
        elif ref["documented"].get(token, {}).get("bare"):
            name, value = token, None
        else:
            name, value = token, argv[i + 1]
            i += 1
        i += 1
        if name in ref["internal"]:
            unknown = set((value or "").split()) - set(ref["internal_values"][name])
            problems += [
                f"{name}: {part} is not among the recorded options" for part in sorted(unknown)
            ]
            continue
        spec = ref["documented"].get(name)
        if spec is None:
            problems.append(f"{name}: not a documented neuronx-cc compile option")
        elif "values" in spec and value not in spec["values"]:
            problems.append(f"{name}: {value!r} is not one of {spec['values']}")
        elif spec.get("int") and not (value or "").isdigit():
            problems.append(f"{name}: {value!r} is not an integer")
    return problems


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("*.argv.json")), ids=lambda p: p.stem)
def test_golden_argv_is_spelled_as_the_cli_reference_documents(golden: Path):
    """Every flag in the golden argv files is a documented neuronx-cc option with a documented
    value, or one of the internal options the reference file records."""
    assert check_against_reference(json.loads(golden.read_text())["argv"]) == []


def test_reference_check_catches_misspellings():
    base = ["neuronx-cc", "compile", "ir/g.hlo.pb", "--framework", "XLA"]
    assert check_against_reference([*base, "--lnc", "2"]) == [
        "--lnc: not a documented neuronx-cc compile option"
    ]
    assert check_against_reference([*base, "--verbose=35"]) == [
        "--verbose: '35' is not one of ['debug', 'info', 'warning', 'error', 'critical']"
    ]
    assert check_against_reference([*base, "--internal-backend-options=--made-up"]) == [
        "--internal-backend-options: --made-up is not among the recorded options"
    ]
    assert check_against_reference([*base, "-O2", "--logical-nc-config", "2"]) == []


def test_an_inductor_rule_changes_only_its_graphs_options(tmp_path):
    """A per_graph rule on decode batch 4: that graph's resolved options (a factor of its
    compile key) change, with the rule as origin, and the miss is explained as the build
    prints it; every other graph's options are unchanged (its cache entry still hits). The
    rebuild itself: tests/e2e/test_build.py (make test-all)."""
    from neffkit.compile.cache.keys import explain_change

    rule = {"match": {"phase": "decode", "batch": 4}, "inductor": {"epilogue_fusion": False}}
    data = {
        "neffkit": 1,
        "name": "rule",
        "model": str(DEMO_MODEL),
        "buckets": {"prefill": [16], "decode": [1, 4], "context": [64]},
    }
    before = load_manifest(_write(tmp_path / "before.yaml", data))
    after = load_manifest(
        _write(tmp_path / "after.yaml", {**data, "compiler": {"per_graph": [rule]}})
    )
    changed = {}
    for spec_before, spec_after in zip(
        make_plan(before).graphs, make_plan(after).graphs, strict=True
    ):
        old, new = resolve_options(before, spec_before), resolve_options(after, spec_after)
        if old.inductor != new.inductor:
            changed[spec_after.name] = (old, new)
    assert list(changed) == ["decode_b4_c64"]
    old, new = changed["decode_b4_c64"]
    assert new.origins["epilogue_fusion"] == "rule 0"
    assert explain_change({"options": old.inductor}, {"options": new.inductor}) == (
        "options changed: epilogue_fusion=(unset) → False"
    )


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
