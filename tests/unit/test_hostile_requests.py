"""Hostile request fields through the server's own path (parse_body → parse_completion /
parse_chat → limits.check_fits → the rows of the graph's inputs): every integer that reaches a
tensor or an index, every float that reaches a graph, every list of ids, each a RequestError
naming its field, never an exception of another kind (a 500, or an engine core that dies).

The request that started it: a stop token id past int64 passed validation, and with min_tokens
the engine core's write_row put it into the graph's int64 bias ids and died, with every request
in flight."""

from __future__ import annotations

import json
from typing import Any

import pytest

from neffkit.contract import abi
from neffkit.contract.abi import GraphShape
from neffkit.contract.records import BucketLists
from neffkit.errors import RequestError
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from neffkit.runtime.serve.protocol import parse_body, parse_chat, parse_completion
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.logit_inputs import Penalties, write_row
from neffkit.runtime.worker.runner import padded_metadata, write_sampling
from tests.fake_model import VOCAB, scheduler_config

BIAS, PENALTY, LOGPROBS = 8, 64, 5
CONFIG = scheduler_config(
    8,
    33,
    BucketLists((8, 16), (1, 4), (32, 64), (1,)),
    bias_tokens=BIAS,
    penalty_tokens=PENALTY,
    max_logprobs=LOGPROBS,
    prompt_logprobs=True,
)
KILLER = {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [2**64]}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BIG = 2**70
DIGITS = "9" * 5000  # past Python's 4300-digit limit on reading an integer


def _write_rows(config: SchedulerConfig, ids: list[int], params: SamplingParams) -> None:
    """What the engine core does with an admitted request: its sampling values and logit
    inputs into a decode graph's rows (the engine masks seeds to 32 bits)."""
    shape = GraphShape(
        phase="decode",
        rows=1,
        tokens=1,
        context=64,
        block_size=8,
        num_blocks=33,
        logprobs=LOGPROBS,
        bitmask_words=0,
        penalty_tokens=PENALTY,
        bias_tokens=BIAS,
    )
    specs = [(name, (1,), dtype) for name, dtype in abi.SAMPLING_INPUTS]
    specs += [(s.name, s.shape, s.dtype) for s in abi.logit_inputs(shape)]
    meta = padded_metadata(tuple(specs))
    seq = SequenceState(0, ids, params, seed=(params.seed or 0) & 0xFFFFFFFF)
    if params.penalized:
        seq.penalties = Penalties(PENALTY, params, ids)
    write_sampling(meta, 0, seq)
    write_row(meta, 0, seq, config.eos_token_ids)


def serve(body: dict[str, Any] | str, chat: bool = False) -> None:
    """The server's path for one body (a dict is sent as Python's json writes it: NaN and
    Infinity included; a str is the raw body); text prompts stand in as two token ids."""
    base = {"model": "m"} if chat else {"model": "m", "prompt": "hi"}
    raw = body if isinstance(body, str) else json.dumps({**base, **body})
    parsed_body = parse_body(raw.encode())
    parsed = (parse_chat if chat else parse_completion)(parsed_body, "m")
    prompts = [p if isinstance(p, list) else [1, 2] for p in parsed.prompts] or [[1, 2]]
    for ids in prompts:
        check_fits(CONFIG, ids, parsed.params)
        _write_rows(CONFIG, ids, parsed.params)


def raw(fields: str) -> str:
    return '{"model": "m", "prompt": "hi", ' + fields + "}"


REFUSED: list[tuple[dict[str, Any] | str, str]] = [
    # stop_token_ids: each id an integer in [0, vocab), at most MAX_STOP_TOKEN_IDS of them
    (KILLER, "stop_token_ids"),
    ({**KILLER, "stop_token_ids": [2**63]}, "stop_token_ids"),
    ({**KILLER, "stop_token_ids": [2**63 - 1]}, "stop_token_ids"),  # int64, not the vocabulary
    ({**KILLER, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({**KILLER, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({**KILLER, "stop_token_ids": [1, -(2**64)]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids"),
    ({"stop_token_ids": [[1]]}, "stop_token_ids"),
    ({"stop_token_ids": 1}, "stop_token_ids"),
    ({"stop_token_ids": [float("nan")]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({**CHAT, "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [2**64]}, "stop_token_ids"),
    # seed: a 64-bit integer, not a boolean
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": BIG}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"seed": [1]}, "seed"),
    (raw(f'"seed": {DIGITS}'), "seed"),
    (raw('"seed": 1e400'), "seed"),
    # max_tokens / max_completion_tokens, min_tokens: integers in [0, 2**63)
    ({"max_tokens": BIG}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": 3.0}, "max_tokens"),  # vLLM refuses non-integers too
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "3"}, "max_tokens"),
    ({"max_tokens": [[1]]}, "max_tokens"),
    ({"max_tokens": float("inf")}, "max_tokens"),
    (raw(f'"max_tokens": -{DIGITS}'), "max_tokens"),
    ({**CHAT, "max_completion_tokens": BIG}, "max_completion_tokens"),
    ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
    ({"min_tokens": BIG}, "min_tokens"),
    ({**CHAT, "min_tokens": BIG}, "min_tokens"),  # chat: no max_tokens to be within
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 2.0}, "min_tokens"),
    # top_k: a 64-bit integer within the bundle's candidates
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": -(2**70)}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": 1.0}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    # n: within MAX_CHOICES
    ({"n": BIG}, "n"),
    ({"n": -BIG}, "n"),
    ({"n": True}, "n"),
    ({"n": 2.0}, "n"),
    # logprobs (completions), top_logprobs (chat)
    ({"logprobs": BIG}, "logprobs"),
    ({"logprobs": 2**63}, "logprobs"),
    ({"logprobs": LOGPROBS + 1}, "logprobs"),
    ({"logprobs": 1.0}, "logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
    # prompt token ids: integers in [0, vocab), in a list or each list of a list
    ({"prompt": [2**64]}, "prompt"),
    ({"prompt": [2**63]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": [[1, 2], [3, 2**64]]}, "prompt"),
    ({"prompt": [[1, 2], [3, -(2**64)]]}, "prompt"),
    ({"prompt": [[1, 2], [VOCAB]]}, "prompt"),
    ({"prompt": [[[1]]]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [1.0]}, "prompt"),
    ({"prompt": [float("nan")]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    # logit_bias: keys decimal token ids in [0, vocab), values finite numbers
    ({"logit_bias": {str(2**64): 1}}, "logit_bias"),
    ({"logit_bias": {str(2**63 - 1): 1}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {" 5": 1}}, "logit_bias"),
    ({"logit_bias": {"1_0": 1}}, "logit_bias"),
    ({"logit_bias": {"\u0663": 1}}, "logit_bias"),  # an Arabic-Indic 3: int() reads it
    ({"logit_bias": {DIGITS: 1}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias"),
    ({"logit_bias": {"5": float("-inf")}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": [1]}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    (raw('"logit_bias": {"5": 1e400}'), "logit_bias"),
    (raw('"logit_bias": {"5": NaN}'), "logit_bias"),
    # floats that reach a graph: finite, within their ranges
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("-inf")}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"temperature": True}, "temperature"),
    (raw('"temperature": 1e400'), "temperature"),
    (raw(f'"temperature": {DIGITS}'), "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": float("inf")}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": 10**400}, "repetition_penalty"),
    # stop strings: at most MAX_STOP_STRINGS of at most MAX_STOP_STRING_CHARS characters
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ({"stop": ["a", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"stop": [["a"]]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    # booleans are booleans, unsupported fields only their no-op values
    ({"echo": 1}, "echo"),
    ({"ignore_eos": 0}, "ignore_eos"),
    ({"best_of": 1.0}, "best_of"),
    ({"best_of": True}, "best_of"),
    # JSON inside JSON: numbers or nesting Python cannot read
    ({"guided_json": '{"maximum": ' + DIGITS + "}"}, "guided_json"),
    ({"guided_json": "[" * 100_000}, "guided_json"),
]


@pytest.mark.parametrize(
    ("body", "param"), REFUSED, ids=[f"{i}-{param}" for i, (_, param) in enumerate(REFUSED)]
)
def test_hostile_fields_are_refused_by_name(body: dict[str, Any] | str, param: str) -> None:
    chat = isinstance(body, dict) and "messages" in body
    with pytest.raises(RequestError) as err:
        serve(body, chat=chat)
    assert err.value.param == param, err.value.message
    assert len(err.value.message) < 400, err.value.message  # no 5000-digit echo


ACCEPTED: list[dict[str, Any] | str] = [
    {"seed": 2**63 - 1},
    {"seed": -(2**63)},
    raw('"seed": -0'),  # JSON's -0 is 0, for every integer field
    raw('"max_tokens": -0, "echo": true, "logprobs": 1'),
    {"max_tokens": 4, "min_tokens": 2, "stop_token_ids": [0, VOCAB - 1]},
    {"max_tokens": 4, "min_tokens": 2, "stop_token_ids": list(range(BIAS - 1))},
    {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
    {"top_k": -1},
    {"top_k": -(2**63)},
    {"temperature": -0.0},
    {"prompt": [0, VOCAB - 1], "max_tokens": 2},
    {"prompt": [[0], [VOCAB - 1]], "max_tokens": 2},
    # finite biases beyond [-100, 100] are clamped, as vLLM does; "-0" and "00" are token 0
    {"logit_bias": {"0": -1e300, str(VOCAB - 1): 10**400, "-0": 5, "00": 1.5}},
    {"stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS},
    {"stop": ["", "a"]},
    {"repetition_penalty": 1.5, "presence_penalty": -0.0},
    {**CHAT, "logprobs": True, "top_logprobs": LOGPROBS, "max_tokens": 2},
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_boundary_values_reach_the_graph_inputs(body: dict[str, Any] | str) -> None:
    serve(body, chat=isinstance(body, dict) and "messages" in body)


def test_logit_bias_keys_naming_one_token_keep_the_last() -> None:
    parsed = parse_completion(
        {"model": "m", "prompt": "hi", "logit_bias": {"0": -1e300, "-0": 5, "00": 1.5, "7": 1e9}},
        "m",
    )
    assert parsed.params.logit_bias == ((0, 1.5), (7, 100.0))


@pytest.mark.parametrize(
    "body",
    [
        '{"model": "m", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"model": "m", "prompt": "hi", "seed": 1' + "0" * 5000,  # truncated, and too long
        b'{"model": "m", "prompt": "\xff"}'.decode("latin-1"),
    ],
)
def test_bodies_python_cannot_read_are_400s(body: str) -> None:
    """Nesting too deep for json (a RecursionError), a truncated body, one not UTF-8: a 400 for
    the body (no field to name)."""
    with pytest.raises(RequestError):
        parse_body(body.encode("latin-1"))
