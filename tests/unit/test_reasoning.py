"""The reasoning parsers' split of a whole output and of the same output streamed in pieces
that cut the tags anywhere (serve/reasoning.py), against vLLM's rules."""

from __future__ import annotations

import pytest

from neffkit.runtime.serve.reasoning import ReasoningStream, split_reasoning

CASES = [
    ("qwen3", "<think>a b</think>c", ("a b", "c")),
    ("qwen3", "no thinking", (None, "no thinking")),  # thinking off: all answer
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("deepseek_r1", "a b</think>c", ("a b", "c")),  # <think> was the template's
    ("deepseek_r1", "<think>a b</think>c", ("a b", "c")),
    ("deepseek_r1", "all reasoning", ("all reasoning", None)),
    ("deepseek_r1", "a</think>", ("a", None)),
]


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_whole_and_streamed_outputs_split_alike(parser, text, want):
    assert split_reasoning(parser, text) == want
    for size in (1, 2, 3, 5):
        stream, reasoning, answer = ReasoningStream(parser), "", ""
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            r, a = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning, answer = reasoning + r, answer + a
        assert (reasoning or None, answer or None) == want, (size, pieces)


def test_a_grammar_after_the_reasoning_waits_for_its_end_token():
    from neffkit.runtime.sampling_params import SamplingParams
    from neffkit.runtime.worker.batch import SequenceState
    from tests.support.matchers import OpenMatcher

    end = 9
    grammar = OpenMatcher()
    seq = SequenceState(0, [1, 2], SamplingParams(max_tokens=10), seed=0)
    seq.grammar, seq.grammar_after = grammar, end
    for token in (5, 6):  # the reasoning: no mask, nothing consumed
        assert seq.active_grammar is None
        seq.append(token, None, 0, ())  # type: ignore[arg-type]
    seq.append(end, None, 0, ())  # type: ignore[arg-type]
    assert seq.active_grammar is grammar and grammar.consumed == []
    seq.append(7, None, 0, ())  # type: ignore[arg-type]
    assert grammar.consumed == [7] and not seq.finished
