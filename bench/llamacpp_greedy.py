"""Greedy tokens of neffkit and llama.cpp against HF transformers (float32) for
bench/llamacpp.py: chat prompts of SmolLM2's template, decoded up to EOS by each system, scored
as identical prompts and tokens before the first difference. Correctness, not speed: apart from
the timed figures so that each reads on its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_build import KINDS, MODEL, guarded  # noqa: E402
from llamacpp_server import LlamaServer  # noqa: E402

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a compiler does in two sentences.",
]
GREEDY_TOKENS = 48


def chat_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": c}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for c in CHATS
    ]


def hf_greedy(prompts: list[list[int]]) -> list[list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    outs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    return outs


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def agreement(got: list[list[int]], want: list[list[int]], eos: set[int]) -> dict[str, Any]:
    """Identical prompts, and tokens before the first difference (EOS itself not counted:
    llama.cpp does not return it)."""
    got = [_until_eos(g, eos) for g in got]
    want = [_until_eos(w, eos) for w in want]
    prefix = 0
    for g, w in zip(got, want, strict=True):
        prefix += next(
            (i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w))
        )
    return {
        "identical": sum(g == w for g, w in zip(got, want, strict=True)),
        "prompts": len(want),
        "tokens_before_first_difference": prefix,
        "reference_tokens": sum(len(w) for w in want),
    }


def llama_greedy(server: Path, model: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LlamaServer(server, model, parallel=1) as srv:
        return [srv.greedy(p, GREEDY_TOKENS) for p in prompts]


def greedy_against_hf(
    llms: dict[str, Any], server: Path, ggufs: dict[str, Path], failures: dict[str, str]
) -> dict[str, dict[str, Any]]:
    from neffkit.runtime.sampling_params import SamplingParams

    prompts = chat_prompts()
    reference = hf_greedy(prompts)
    config = json.loads((MODEL / "generation_config.json").read_text())
    eos = config.get("eos_token_id")
    eos = set(eos) if isinstance(eos, list) else {eos}
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0)
    out: dict[str, dict[str, Any]] = {}
    for kind, llm in llms.items():
        got = [list(s.output_ids) for s in llm.generate(prompts, params)]
        out[f"neffkit_{kind}"] = agreement(got, reference, eos)
        got = guarded(
            failures,
            f"{KINDS[kind]} greedy",
            lambda kind=kind: llama_greedy(server, ggufs[kind], prompts),
        )
        if got is not None:
            out[f"llamacpp_{KINDS[kind]}"] = agreement(got, reference, eos)
    return out
