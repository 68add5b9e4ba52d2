"""Device-resident decode state (manifest `decode_state: device`): decode graphs read each row's
token from the aliased `last_tokens` state that the previous step (prefill or decode) wrote, and
the host sends only which sequence each row holds. The tokens must be the host path's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from neffkit.compile.layout import graph_inputs, model_layout
from neffkit.compile.units import GraphSpec
from neffkit.contract.abi import GraphKey, Phase
from neffkit.manifest import load_manifest
from neffkit.models.weights import load_weights
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.runner import DecodeBuffers, GraphEntry
from tests.eager import EagerGraphs
from tests.support.models import write_manifest

BS, CONTEXT = 16, 32
PROMPTS = {1: [5, 17, 300, 42, 7], 3: [9, 8, 7, 6, 5, 4, 3]}  # first block → prompt
BLOCKS = {1: [1, 2], 3: [3, 4]}


def _graphs(layout, weights: dict[str, torch.Tensor]) -> EagerGraphs:
    """A packed prefill of 2 sequences and a decode of 2 rows."""
    prefill = GraphSpec("prefill_b2_t16_c32", "prefill", 2, 16, CONTEXT)
    decode = GraphSpec("decode_b2_c32", "decode", 2, 1, CONTEXT)
    return EagerGraphs(layout, weights, prefill, decode)


def _prefill_meta() -> dict[str, np.ndarray]:
    """Both prompts packed into one row of 16 tokens."""
    ids, pos, slots, seq_ids = (np.zeros((1, 16), np.int64) for _ in range(4))
    slots[:] = -1
    at = 0
    tables = np.full((2, CONTEXT // BS), -1, np.int64)
    lens, last = np.zeros(2, np.int64), np.zeros(2, np.int64)
    for row, (first, prompt) in enumerate(PROMPTS.items()):
        n = len(prompt)
        ids[0, at : at + n], pos[0, at : at + n], seq_ids[0, at : at + n] = prompt, range(n), row
        slots[0, at : at + n] = first * BS + np.arange(n)
        tables[row] = BLOCKS[first]
        lens[row], last[row] = n, at + n - 1
        at += n
    return {
        "input_ids": ids,
        "positions": pos,
        "slot_mapping": slots,
        "seq_ids": seq_ids,
        "block_tables": tables,
        "context_lens": lens,
        "last_token_index": last,
        "seq_slots": np.array(list(PROMPTS)),
        "temperature": np.full(2, 0.8, np.float32),
        "top_k": np.zeros(2, np.int64),
        "top_p": np.ones(2, np.float32),
        "seed": np.array([11, 12]),
    }


def _generate(graphs: EagerGraphs, steps: int) -> dict[int, list[int]]:
    """Prefill both prompts, then decode `steps` times; the rows swap sequences at step 2 (a
    row taken over by another sequence must read that sequence's token)."""
    tokens = graphs.run(graphs.prefill, _prefill_meta())
    out = {first: [int(t)] for first, t in zip(PROMPTS, tokens, strict=True)}
    for step in range(steps):
        order = list(PROMPTS) if step < 2 else list(PROMPTS)[::-1]
        pos = np.array([[len(PROMPTS[f]) + len(out[f]) - 1] for f in order])
        meta = {
            "input_ids": np.array([[out[f][-1]] for f in order]),
            "seq_slots": np.array(order),
            "positions": pos,
            "slot_mapping": np.array([[f * BS + p[0]] for f, p in zip(order, pos, strict=True)]),
            "block_tables": np.array([BLOCKS[f] for f in order]),
            "context_lens": pos[:, 0] + 1,
            "temperature": np.full(2, 0.8, np.float32),
            "top_k": np.zeros(2, np.int64),
            "top_p": np.ones(2, np.float32),
            "seed": np.array([11 + (f == 3) for f in order]),
        }
        for f, t in zip(order, graphs.run(graphs.decode, meta), strict=True):
            out[f].append(int(t))
    return out


def test_device_state_samples_the_host_paths_tokens(hf_model_dir, tmp_path):
    """Eager graphs of both forms on the same checkpoint: a packed prefill, then sampled decode
    steps with the rows swapping sequences; the device form's tokens and K/V are the host's."""
    path = write_manifest(
        tmp_path / "m.yaml",
        hf_model_dir("llama"),
        buckets={"prefill": [16], "decode": [2], "context": [CONTEXT], "prefill_batch": [1, 2]},
    )
    manifest = load_manifest(path)
    host = model_layout(manifest, "cpu")
    device = dataclasses.replace(host, decode_state="device")
    weights = load_weights(manifest.model, manifest.model_config, host.storage)
    runs = {}
    for name, layout in (("host", host), ("device", device)):
        graphs = _graphs(layout, weights)
        runs[name] = (_generate(graphs, 5), graphs.state)
    (host_tokens, host_state), (device_tokens, device_state) = runs["host"], runs["device"]
    assert device_tokens == host_tokens
    assert len({tuple(t) for t in host_tokens.values()}) == 2  # the two sequences differ
    for name, cache in host_state.items():
        assert torch.equal(cache, device_state[name]), name
    # the state holds each sequence's last token at its slot
    last = device_state["last_tokens"]
    assert {f: int(last[f]) for f in PROMPTS} == {f: t[-1] for f, t in device_tokens.items()}


def test_manifest_decode_state_defaults_and_validation(hf_model_dir, tmp_path):
    from neffkit.errors import ManifestError

    def load(**fields):
        return load_manifest(write_manifest(tmp_path / "m.yaml", hf_model_dir("llama"), **fields))

    assert load().decode_state == "host"  # cpu: the host sends tokens (no measured gain here)
    assert load(target="neuron").decode_state == "device"
    assert load(target="neuron", decode_state="host").decode_state == "host"
    with pytest.raises(ManifestError, match=r"decode_state: unknown value 'gpu'"):
        load(decode_state="gpu")


def _entry(layout, rows: int) -> GraphEntry:
    _, specs = graph_inputs(layout, GraphSpec(f"decode_b{rows}_c32", "decode", rows, 1, 32))
    meta = tuple((s.name, s.shape, s.dtype) for s in specs if s.name in META_NAMES)
    key = GraphKey(Phase.DECODE, rows, 1, 32)
    return GraphEntry(name=key.name, key=key, meta_specs=meta, run=lambda m: [])


META_NAMES = {
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "context_lens",
    "seq_slots",
    "temperature",
    "top_k",
    "top_p",
    "seed",
}


def test_decode_metadata_bytes_per_step(hf_model_dir, tmp_path):
    """What a steady decode step rewrites (what a device executor uploads): positions, slots,
    lengths, and with host state the tokens; a row changing hands rewrites its tables and
    sampling values (and seq_slots) too."""
    path = write_manifest(
        tmp_path / "m.yaml",
        hf_model_dir("llama"),
        buckets={"prefill": [16], "decode": [4], "context": [32]},
    )
    host = model_layout(load_manifest(path), "cpu")
    params = SamplingParams(max_tokens=8)
    seqs = [
        SequenceState(
            i, [1, 2, 3], params, seed=0, output_ids=[4], kv_blocks=[[1 + 2 * i, 2 + 2 * i]]
        )
        for i in range(4)
    ]
    for s in seqs:  # the scheduler's choice of state slot
        s.state_slot = s.blocks[0]
    sent = {}
    device = dataclasses.replace(host, decode_state="device")
    for name, layout in (("host", host), ("device", device)):
        buffers = DecodeBuffers(_entry(layout, 4), BS)
        first = buffers.fill(seqs)
        for s in seqs:
            s.output_ids.append(5)
        steady = buffers.fill(seqs)
        if name == "device":
            assert buffers.meta["seq_slots"].tolist() == [1, 3, 5, 7]  # each sequence's slot
        sent[name] = (first, steady)
        for s in seqs:
            s.output_ids.pop()
    assert sent["host"][1] == 4 * 4 * 8  # tokens, positions, slots, lengths: 4 rows of int64
    assert sent["device"][1] == 3 * 4 * 8  # the tokens stay on the device
    assert sent["device"][0] > sent["device"][1] and sent["host"][0] > sent["host"][1]


def test_a_preempted_request_back_in_its_row_gets_its_new_blocks(hf_model_dir, tmp_path):
    """After a preemption a request recomputes into other blocks; if it lands in the row it had,
    at the same block count, its table and (device state) seq_slots are rewritten all the same."""
    path = write_manifest(
        tmp_path / "m.yaml",
        hf_model_dir("llama"),
        buckets={"prefill": [16], "decode": [4], "context": [32]},
    )
    layout = dataclasses.replace(model_layout(load_manifest(path), "cpu"), decode_state="device")
    buffers = DecodeBuffers(_entry(layout, 4), BS)
    seq = SequenceState(7, [1, 2, 3], SamplingParams(max_tokens=8), seed=0, output_ids=[4])
    seq.blocks, seq.state_slot = [1, 2], 3
    buffers.fill([seq])
    seq.blocks, seq.preemptions, seq.state_slot = [5, 6], 1, 5  # recomputed into blocks 5, 6
    buffers.fill([seq])
    assert buffers.meta["block_tables"][0].tolist()[:1] == [5]
    assert buffers.meta["seq_slots"][0] == 5
