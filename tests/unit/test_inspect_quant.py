"""`neffkit inspect`'s quantized-weight rows, from bundle.json's scheme ids and the shards'
headers alone (neffkit/inspect/quant.py): the ids read as kernels/intquant.py writes them, and
every part's bytes (codes, high-bit planes, scales, zero points or minimums) of shards written
by safetensors itself. No build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from neffkit.inspect.quant import describe, parse_scheme, shard_header, size, weight_row
from neffkit.kernels.intquant import QuantScheme, pack_codes

SCHEMES = [
    QuantScheme("sym", 4, 32, zero=8),
    QuantScheme("sym", 8, 0, zero=128),
    QuantScheme("zero", 4, 128),
    QuantScheme("min", 5, 32),
    QuantScheme("sym", 6, 16, zero=32),
    QuantScheme("e2m1", 4, 32),
    QuantScheme("sym", 8, 0, zero=128, activations="int8-token"),
    QuantScheme("min", 4, 32, activations="int8-block"),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.to_id())
def test_scheme_ids_read_as_intquant_writes_them(scheme: QuantScheme) -> None:
    fields = parse_scheme(scheme.to_id())
    assert QuantScheme(**fields) == scheme


def test_descriptions_and_sizes_are_for_people() -> None:
    assert describe(parse_scheme("sym:b4:g32:z8")) == "int4 sym (zero 8), groups of 32"
    assert describe(parse_scheme("e2m1:b4:g32")) == "fp4 e2m1, groups of 32"
    w8a8 = describe(parse_scheme("sym:b8:g0:z128:a:int8-token"))
    assert w8a8 == "int8 sym (zero 128), per output channel, int8 activations per token"
    assert describe(parse_scheme("min:b5:g32")) == "int5 minimums, groups of 32"
    q8 = describe(parse_scheme("sym:b8:g32:z128:a:int8-block"))
    assert q8 == "int8 sym (zero 128), groups of 32, int8 activations per block of 32"
    assert [size(n) for n in (512, 1536, 3 << 20, 5 << 30)] == [
        "512 B",
        "1.5 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]


def _shard(path: Path, schemes: dict[str, QuantScheme], shape: tuple[int, int]) -> Path:
    """A shard as the build writes it: each weight's stored parts by intquant's own packing."""
    out, cols = shape
    tensors: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(cols)}
    for name, scheme in schemes.items():
        codes = torch.randint(0, 1 << scheme.bits, shape, dtype=torch.uint8)
        for suffix, part in pack_codes(codes, scheme.bits).items():
            tensors[name + suffix] = part
        groups = cols // scheme.group_of(cols)
        tensors[name + ".qscale"] = torch.rand(out, groups)
        if scheme.aux:
            tensors[name + scheme.aux] = torch.rand(out, groups)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    ("scheme", "bits_per_weight"),
    [
        (QuantScheme("sym", 4, 32, zero=8), 5.0),  # 4 + 32/32
        (QuantScheme("min", 5, 32), 7.0),  # 5 + two float32 per 32 (Q5_1, Q5_K)
        (QuantScheme("sym", 6, 16, zero=32), 8.0),  # 6 + 32/16 (Q6_K)
        (QuantScheme("zero", 4, 128), 4.5),  # AWQ g128
        (QuantScheme("sym", 8, 0, zero=128), 8.25),  # a float32 scale a row of 128
    ],
    ids=lambda v: v.to_id() if isinstance(v, QuantScheme) else str(v),
)
def test_a_weight_row_counts_every_part_over_every_rank(
    scheme: QuantScheme, bits_per_weight: float, tmp_path: Path
) -> None:
    out, cols = 64, 128
    name = "model.layers.0.mlp.down_proj.weight"
    shards = [
        _shard(tmp_path / f"rank{r}.safetensors", {name: scheme}, (out, cols)) for r in (0, 1)
    ]
    headers = [shard_header(path) for path in shards]
    row = weight_row(name, scheme.to_id(), headers)
    assert row["shape"] == [out, cols]
    stored = {s: torch.Size(shape).numel() for s, (shape, _) in scheme.stored((out, cols)).items()}
    assert row["codes_bytes"] == 2 * stored[""]
    assert row["high_bytes"] == 2 * stored.get(".qhigh", 0)
    assert row["scale_bytes"] == 2 * 4 * stored[".qscale"]
    assert row["aux_bytes"] == (2 * 4 * stored[scheme.aux] if scheme.aux else 0)
    assert row["float32_bytes"] == 2 * out * cols * 4
    assert row["bits_per_weight"] == bits_per_weight
