"""Hostile requests against the engine's own work (no server, no bundle): stop strings whose
matching cost grew with the output, output that never completes a character, grammars too large
or too slow to compile (and an engine core that compiled them inside its step loop), and model
vocabularies with ids their tokenizer has no token for."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from neffkit.errors import RequestError
from neffkit.runtime.engine.core import EngineCore
from neffkit.runtime.engine.core_client import EngineClient
from neffkit.runtime.engine.detokenizer import (
    MAX_PENDING_TOKENS,
    REPLACEMENT,
    IncrementalDetokenizer,
)
from neffkit.runtime.engine.structured import GrammarLimits, Grammars
from neffkit.runtime.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
    StructuredSpec,
)
from neffkit.runtime.tokenizer import Tokenizer
from tests.fake_model import fake_runner
from tests.support.models import DEMO_MODEL

# ---------------------------------------------------------------- the implementation before


class OldDetokenizer:
    """The detokenizer as it was (whole text kept, each stop string's prefixes tried at every
    step): the reference for the semantics the incremental one keeps."""

    def __init__(self, tokenizer, stop=(), include_stop=False, min_tokens=0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = self.emitted = 0
        self.text = ""
        self.stopped = False
        self.max_pending = 0  # the most tokens it waited on for a split character

    def _decode_new(self) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.ids[self.prefix_offset :])
        if len(window) <= len(before) or window.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(before) :]

    def step(self, new_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += new_ids
        new = self._decode_new()
        self.max_pending = max(self.max_pending, len(self.ids) - self.read_offset)
        self.text += new
        if self.stop and new and len(self.ids) > self.min_tokens:
            longest = max(len(s) for s in self.stop)
            start = max(0, len(self.text) - len(new) - longest + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text, self.stopped = self.text[: i + len(s) if self.include_stop else i], True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def finish(self) -> str:
        if not self.stopped and self.read_offset < len(self.ids):
            window = self.tokenizer.decode(self.ids[self.prefix_offset :])
            before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += window[len(before) :]
            self.read_offset = len(self.ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out

    def _held_back(self) -> int:
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer.from_dir(DEMO_MODEL)
    assert tokenizer is not None
    return tokenizer


class CountingTokenizer:
    """The demo tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids)


def _run(detok, ids: list[int], chunks: list[int]) -> list[tuple[str, bool]]:
    """Each step's piece and whether it stopped, then finish's piece."""
    out, i, k = [], 0, 0
    while i < len(ids) and not detok.stopped:
        n = chunks[k % len(chunks)]
        out.append((detok.step(ids[i : i + n]), detok.stopped))
        i, k = i + n, k + 1
    out.append((detok.finish(), detok.stopped))
    return out


# ---------------------------------------------------------------- stop strings: semantics

ALPHABET = "ab \nxé🙂"  # few letters: stop strings occur, overlap and share prefixes
texts = st.text(alphabet=ALPHABET, min_size=0, max_size=60)
stop_strings = st.lists(st.text(alphabet=ALPHABET, min_size=0, max_size=6), max_size=6)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=texts,
    stops=stop_strings,
    cuts=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=3),
    include=st.booleans(),
    min_tokens=st.integers(0, 6),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
)
def test_stop_strings_match_the_old_implementation(
    tok, text, stops, cuts, include, min_tokens, chunks
) -> None:
    """Random text, stop strings (random ones and pieces of the text), include_stop,
    min_tokens and step sizes: every piece, and where it stops, as before (where the old one
    never waited on MAX_PENDING_TOKENS tokens for a character: then the new one shows it)."""
    stops = stops + [text[a : a + n] for a, n in cuts]
    ids = tok.encode(text, add_special_tokens=False)
    args = (tuple(stops), include, min_tokens)
    old = OldDetokenizer(tok, *args)
    want = _run(old, ids, chunks)
    assume(old.max_pending < MAX_PENDING_TOKENS)
    assert _run(IncrementalDetokenizer(tok, *args), ids, chunks) == want


def test_speculative_steps_stop_where_the_old_implementation_did(tok) -> None:
    """Several tokens of one step go in one at a time: the same tokens are kept."""
    text = "ab ab a\nb xx aé🙂 ab\n" * 3
    ids = tok.encode(text, add_special_tokens=False)
    for stops in (("b x",), ("🙂 a", "é"), ("a\nb", "ab ab a\nb"), ("zz",)):
        new, old = IncrementalDetokenizer(tok, stops), OldDetokenizer(tok, stops)
        assert EngineClient._detokenize(new, ids) == EngineClient._detokenize(old, ids)  # type: ignore[arg-type]


# ---------------------------------------------------------------- stop strings: cost

HOSTILE_STOPS = tuple(
    "z" * (MAX_STOP_STRING_CHARS - 2) + f"{i:02d}" for i in range(MAX_STOP_STRINGS)
)


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    out = []
    for token in ids:
        out.append(detok.step([token]))
        # only the held-back text and what a stop string may start in are kept
        assert len(detok._text) <= detok.stop.longest - 1 + 8
    return "".join(out) + detok.finish()


@pytest.mark.parametrize(
    "text",
    [
        "z" * 6000,  # every suffix a prefix of all 64 stop strings: 255 characters held back
        "zzzz zq" * 1000,  # held back, then let go, again and again
        "the quick brown fox " * 300,  # nothing like a stop string
    ],
)
def test_stop_matching_work_is_bounded_per_token_not_by_the_output(tok, text) -> None:
    """64 stop strings of 256 characters over a long output: the characters searched per
    token are bounded by the new text and the stop set (the old implementation searched the
    whole text's prefixes of each string at each step, and kept the whole text)."""
    ids = tok.encode(text, add_special_tokens=False)
    half = IncrementalDetokenizer(tok, HOSTILE_STOPS)
    assert _feed(half, ids[: len(ids) // 2]) == tok.decode(ids[: len(ids) // 2])
    whole = IncrementalDetokenizer(tok, HOSTILE_STOPS)
    assert _feed(whole, ids) == text
    per_step = (MAX_STOP_STRING_CHARS + 8) * (MAX_STOP_STRINGS + MAX_STOP_STRING_CHARS)
    assert whole.stop.scanned <= len(ids) * per_step
    assert whole.stop.scanned <= 2.2 * half.stop.scanned  # linear in the output


def test_a_long_output_stops_at_its_end(tok) -> None:
    text = "z" * 3000 + "z" * 254 + "07"
    ids = tok.encode(text, add_special_tokens=False)
    assert _feed(IncrementalDetokenizer(tok, HOSTILE_STOPS), ids) == "z" * 3000


# ---------------------------------------------------------------- output that never decodes


def test_invalid_bytes_forever_cost_linear_decoding(tok) -> None:
    """A request can force a byte token that never completes a character (logit_bias): its
    U+FFFD is shown after MAX_PENDING_TOKENS tokens instead of every step decoding the whole
    output again; the text is a full decode's."""
    byte = next(i for i in range(1024) if tok.decode([i]) == REPLACEMENT)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, ("zz",))  # type: ignore[arg-type]
    ids = [byte] * 2000
    text = "".join(detok.step([t]) for t in ids) + detok.finish()
    assert text == tok.decode(ids)
    assert counting.decoded <= len(ids) * 4 * MAX_PENDING_TOKENS


def test_a_character_split_after_many_tokens_is_not_broken(tok) -> None:
    """Valid text that has waited MAX_PENDING_TOKENS tokens (one long speculative step ending
    inside a character) shows what is whole and keeps the split character's tokens waiting."""
    text = "ab" * MAX_PENDING_TOKENS + "🙂é"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    first = detok.step(ids[:-1])  # up to the middle of é
    assert first == "ab" * MAX_PENDING_TOKENS + "🙂"
    assert first + detok.step(ids[-1:]) + detok.finish() == text


# ---------------------------------------------------------------- grammars: compile limits

SLOW_REGEX = "(a|b)*a(a|b){30}"  # a lexer of 2^31 states, built lazily
HUGE_REGEX = "(a{1000}){1000}"  # compiles in a millisecond, fails at its first token
LONG_REGEX = "a{1000000}"  # the same, in half a second


@pytest.fixture
def grammars(tok) -> Grammars:
    made = Grammars.of(tok, 1024, (0,), GrammarLimits(timeout_s=60))  # a busy host: no deadline
    assert made is not None
    return made


def test_a_grammar_too_large_to_compile_is_a_400_naming_its_field(grammars) -> None:
    """It was accepted, and its first token failed the engine's matcher: a 500 "engine
    failed". Now the check walks it, and a refusal is remembered."""
    spec = StructuredSpec("regex", HUGE_REGEX, "guided_regex")
    with pytest.raises(RequestError, match="too large or too slow to compile") as err:
        grammars.check(spec)
    assert err.value.param == "guided_regex" and "too many expressions" in err.value.message
    t0 = time.perf_counter()
    with pytest.raises(RequestError) as err:  # refused from the cache, naming its own field
        grammars.check(dataclasses.replace(spec, field="structured_outputs"))
    assert err.value.param == "structured_outputs" and time.perf_counter() - t0 < 0.05
    assert err.value.message.startswith("structured_outputs: the regex is too large")
    grammars.check(StructuredSpec("regex", SLOW_REGEX, "guided_regex"))  # cheap on this vocab


def test_a_grammar_slower_than_the_deadline_is_a_400(tok) -> None:
    grammars = Grammars.of(tok, 1024, (0,), GrammarLimits(timeout_s=0.05))
    assert grammars is not None
    grammars.vocab  # noqa: B018 - built first: only the compile counts
    t0 = time.perf_counter()
    with pytest.raises(RequestError, match="--grammar-timeout") as err:
        grammars.check(StructuredSpec("regex", LONG_REGEX, "response_format"))
    assert err.value.param == "response_format" and time.perf_counter() - t0 < 2


def test_prepare_never_waits_on_a_compile(grammars) -> None:
    grammars.vocab  # noqa: B018
    t0 = time.perf_counter()
    pending = grammars.prepare(StructuredSpec("regex", LONG_REGEX, "guided_regex"))
    assert time.perf_counter() - t0 < 0.05 and not pending.done()
    with pytest.raises(RequestError):
        pending.result(timeout=60)
    ok = grammars.prepare(StructuredSpec("regex", "[0-9]{3}", "guided_regex")).result(60)
    assert grammars.prepare(StructuredSpec("regex", "[0-9]{3}", "guided_regex")).done()
    assert not ok.is_error()


class _Matcher:
    """A grammar that allows everything (the fake model's graphs take no bitmask)."""

    def deep_copy(self) -> _Matcher:
        return self

    def consume_token(self, token: int) -> bool:
        return True

    def is_stopped(self) -> bool:
        return False


class _SlowGrammars:
    """Grammars whose compile the test finishes when it likes."""

    def __init__(self) -> None:
        self.compiles: list[Future] = []

    def prepare(self, spec: StructuredSpec) -> Future:
        self.compiles.append(Future())
        return self.compiles[-1]


def _core(grammars: _SlowGrammars) -> EngineCore:
    runner, _ = fake_runner()
    layout = dataclasses.replace(runner.config.layout, bitmask_words=4)
    runner.config = dataclasses.replace(runner.config, layout=layout)
    return EngineCore(runner, grammars=grammars)  # type: ignore[arg-type]


def test_the_engine_steps_while_a_grammar_compiles() -> None:
    """The engine core compiled a new grammar inside its step loop, so every other stream
    waited on it; now it is queued once its compile is done, and others step meanwhile."""
    slow = _SlowGrammars()
    core = _core(slow)
    spec = StructuredSpec("regex", "a", "guided_regex")
    params = SamplingParams(max_tokens=4, ignore_eos=True, structured=spec)
    constrained, refused = (core.add_request([1, 2, 3], params) for _ in range(2))
    plain = core.add_request([4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    while not plain.finished:
        t0 = time.perf_counter()
        core.step()
        assert time.perf_counter() - t0 < 1
    assert plain.finish_reason == "length" and not constrained.output_ids and core.has_work()
    slow.compiles[0].set_result(_Matcher())
    slow.compiles[1].set_exception(RequestError("no", param="guided_regex"))
    while core.has_work():
        core.step()
    assert constrained.finish_reason == "length" and len(constrained.output_ids) == 4
    assert refused.finish_reason == "error" and not refused.output_ids


def test_a_request_aborted_while_its_grammar_compiles_is_never_queued() -> None:
    slow = _SlowGrammars()
    core = _core(slow)
    spec = StructuredSpec("regex", "a", "guided_regex")
    seq = core.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured=spec))
    core.abort(seq)
    slow.compiles[0].set_result(_Matcher())
    core.step()
    assert not core.has_work() and seq.finish_reason == "abort" and not seq.output_ids


# ---------------------------------------------------------------- vocabulary holes


def _byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer of 257 tokens (256 bytes and <eos>, id 256), built with the
    tokenizers library."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<eos>"])
    return Tokenizer(hf, {})


def _allowed(grammars: Grammars, spec: StructuredSpec, rows: int = 1) -> list[np.ndarray]:
    """The ids each of `rows` fresh matchers' first masks allow (through Grammars.fill)."""
    words = -(-grammars.vocab_size // 32)
    mask = np.full((rows, words), -1, dtype=np.int32)
    grammars.fill(mask, [(grammars.matcher(spec), r) for r in range(rows)])
    return [np.flatnonzero(np.unpackbits(m.view(np.uint8), bitorder="little")) for m in mask]


@pytest.mark.parametrize("rows", [1, 20])  # row by row, and on llguidance's thread pool
def test_ids_without_a_token_are_never_allowed(rows) -> None:
    """A model vocabulary padded past its tokenizer's (300 ids, 257 tokens) whose
    end-of-sequence id lies in the padding (299): every structured request was a 500 (the
    grammar library refused the tokenizer); and a grammar could name a padding id."""
    tok = _byte_tokenizer()
    grammars = Grammars.of(tok, 300, (299, 256))
    assert grammars is not None
    anything = StructuredSpec("regex", "(.|\n)*", "guided_regex")
    for allowed in _allowed(grammars, anything, rows):
        assert len(allowed) and allowed.max() < 257
    named = StructuredSpec("grammar", 'start: "a" | <[280]>', "guided_grammar")
    for allowed in _allowed(grammars, named, rows):
        assert allowed.tolist() == tok.encode("a", add_special_tokens=False)
    done = grammars.matcher(StructuredSpec("regex", "a", "guided_regex"))
    assert done.consume_token(tok.encode("a", add_special_tokens=False)[0])


def test_a_tokenizer_wider_than_the_model_is_cut_to_the_model() -> None:
    """A tokenizer with more tokens than the model has ids (Gemma 3's 262,145 and 262,144):
    the grammar library refused it; now masks hold only the model's ids."""
    grammars = Grammars.of(_byte_tokenizer(), 250, (0,))
    assert grammars is not None
    for allowed in _allowed(grammars, StructuredSpec("regex", "(.|\n)*", "guided_regex"), 20):
        assert len(allowed) and allowed.max() < 250
