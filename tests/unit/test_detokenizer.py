"""Incremental detokenization and stop strings against the demo tokenizer (no bundle needed)."""

from __future__ import annotations

import random

import pytest

from neffkit.runtime.engine.detokenizer import IncrementalDetokenizer
from neffkit.runtime.tokenizer import Tokenizer
from tests.support.models import DEMO_MODEL

TEXT = (
    'def main(argv):\n    """Parse the arguments."""\n\n    return café(argv) + \'naïve\' 🙂\n\n'
    "class Foo:\n    pass\n"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer.from_dir(DEMO_MODEL)
    assert tokenizer is not None
    return tokenizer


def _stream(tok: Tokenizer, ids: list[int], stop=(), include=False, seed=0) -> list[str]:
    """Feed ids in random-sized chunks; return the pieces emitted (finish included)."""
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tok, tuple(stop), include)
    pieces, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 3)
        pieces.append(detok.step(ids[i : i + n]))
        i += n
    pieces.append(detok.finish())
    return pieces


def test_pieces_add_up_to_the_full_decode_without_split_characters(tok) -> None:
    ids = tok.encode(TEXT)
    multibyte = [i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[i : i + 1])]
    assert multibyte, "the text should contain characters split over byte tokens"
    for seed in range(5):
        pieces = _stream(tok, ids, seed=seed)
        assert "".join(pieces) == tok.decode(ids) == TEXT
        assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("stop", ["\n\n", "Parse", "é(", "'na", "🙂", "\n    pass", "xyz"])
def test_stop_strings_cut_right_before_the_first_occurrence(tok, stop) -> None:
    ids = tok.encode(TEXT)
    want = TEXT.split(stop, 1)[0]
    for seed in range(5):
        pieces = _stream(tok, ids, stop=[stop], seed=seed)
        assert "".join(pieces) == want, (stop, seed)
        # what was shown before the stop matched is never taken back: pieces only append
    kept = _stream(tok, ids, stop=[stop], include=True)
    assert "".join(kept) == (want + stop if stop in TEXT else TEXT)


def test_the_earliest_of_several_stop_strings_wins(tok) -> None:
    ids = tok.encode(TEXT)
    assert "".join(_stream(tok, ids, stop=["class", "return"])) == TEXT.split("return", 1)[0]


def test_tokens_of_one_step_stop_at_the_stop_string(tok) -> None:
    """A speculative step delivers several tokens at once: the ones after the token that
    completes a stop string are not reported (the text stops before the stop string)."""
    from neffkit.runtime.engine.core_client import EngineClient

    ids = tok.encode(TEXT)
    stop = "return"
    cut = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    detok = IncrementalDetokenizer(tok, (stop,), False)
    text, kept = EngineClient._detokenize(detok, ids)  # every token in one step
    assert kept == ids[:cut] and detok.stopped
    assert text == tok.decode(ids[:cut]).split(stop)[0]
    plain = IncrementalDetokenizer(tok, (), False)  # without stop strings: all of them at once
    text, kept = EngineClient._detokenize(plain, ids)
    assert kept == ids and text + plain.finish() == tok.decode(ids)
