"""Structured outputs on the host: grammars compiled with llguidance (one of vLLM's two
backends), one matcher per request advanced by each emitted token, and the token bitmask each
step's graph applies before sampling (kernels/logits.py).

A JSON schema, a regex, a list of choices or a Lark / GBNF grammar becomes llguidance's grammar
text once per distinct source (cached); each request gets its own matcher from it. The matcher's
bitmask for the next token is written into the graph's `token_bitmask` rows (bit v % 32 of word
v // 32 allows token v), many rows at once on llguidance's own threads. A grammar that is
complete and allows nothing more ends its request (the scheduler); one that is complete but may
go on allows the end-of-sequence tokens too.

Compiling is bounded (GrammarLimits): llguidance's own limits (grammar size, lexer fuel and
states, Earley items per step), then a walk of PROBE_TOKENS tokens along the lowest token id each
mask allows, which builds the lexer's first states (llguidance builds them lazily, at the first
masks: `(a{1000}){1000}` compiles in a millisecond and fails at its first token) — all of it on
a worker thread, within `timeout_s`. A grammar that fails any of it is a 400 naming its field,
and is remembered as refused. The engine core compiles on the same threads (`prepare`), so its
step loop never waits on a grammar.

Token ids without a token (a model's vocabulary padded past its tokenizer's, as Qwen's 151,936
against 151,665) are never allowed: every mask is cut to the ids the tokenizer has.

llguidance is imported when the first grammar is compiled: a bundle that never sees one does not
need it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from neffkit.errors import RequestError
from neffkit.runtime import json_bounds
from neffkit.runtime.sampling_params import StructuredSpec
from neffkit.runtime.tokenizer import Tokenizer

CACHED_GRAMMARS = 256  # distinct grammar sources kept compiled or refused (least recent dropped)
PARALLEL_ROWS = 16  # constrained rows from which masks are filled on llguidance's threads
PROBE_TOKENS = 8  # tokens a new grammar is walked before it is accepted
COMPILE_THREADS = 2  # grammars compiled at once (a slow one keeps its thread until it ends)
COMPILE_NICENESS = 10  # added to a grammar thread's niceness
LIMITS_HINT = (
    "a smaller schema, regex or grammar (docs/serving.md#structured-outputs-and-tool-calls)"
)


@dataclass(frozen=True)
class GrammarLimits:
    """What compiling one grammar may cost. The llguidance limits are its defaults, written out
    (docs/serving.md#structured-outputs-and-tool-calls); `timeout_s` is `--grammar-timeout`."""

    timeout_s: float = 5.0  # compile and probe walk, wall clock
    max_grammar_size: int = 500_000  # symbols in the grammar's productions
    initial_lexer_fuel: int = 1_000_000  # building the lexer's regexes (~50k/ms)
    step_lexer_fuel: int = 200_000  # lexer work for one token's mask (~14k/ms)
    step_max_items: int = 50_000  # Earley items for one token's mask (~20k/ms)
    max_items_in_row: int = 2_000  # a grammar row's branching
    max_lexer_states: int = 250_000  # ~1-2 kB each

    def llguidance(self) -> Any:
        return _llguidance().LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,  # an error names the limit, not the parser's state
        )


class GrammarRefused(RequestError):
    """A constraint that cannot be compiled, remembered by its source, whichever field sent
    it: `of(spec)` is the 400 that names the field."""

    def of(self, spec: StructuredSpec) -> RequestError:
        field = spec.schema_field or spec.field
        return RequestError(f"{field}: {self.message}", hint=self.own_hint, param=field)


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the bitmask helpers
    except ImportError:
        raise RequestError(
            "structured outputs need the llguidance package, which is not installed here",
            hint="pip install llguidance (a dependency of neffkit)",
            param="response_format",
        ) from None
    return llguidance


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for a constraint (not yet checked against a tokenizer)."""
    llg = _llguidance()
    try:
        if spec.kind == "json":
            flexible = spec.any_whitespace is not False
            options: dict[str, Any] = {"whitespace_flexible": flexible}
            if flexible:
                options["whitespace_pattern"] = json_bounds.WHITESPACE
            schema = json.dumps(json_bounds.closed(json.loads(spec.source)))
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        return llg.grammar_from({"regex": "regex", "grammar": "grammar"}[spec.kind], spec.source)
    except (ValueError, TypeError) as exc:  # llguidance raises ValueError for bad sources
        raise GrammarRefused(f"cannot compile the {spec.kind}: {exc}") from None
    except RecursionError:
        raise GrammarRefused(f"cannot compile the {spec.kind}: nested too deeply") from None


def _background() -> None:
    """A grammar thread yields the CPU to serving (Linux sets a thread's own niceness): a slow
    grammar on a busy host delays its own answer, not other streams' tokens."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


@dataclass
class Vocabulary:
    """llguidance's tokenizer over a model's token ids, and which ids have a token."""

    tokenizer: Any  # llguidance.LLTokenizer
    words: int  # int32 words of llguidance's masks (the tokenizer may be wider than the model)
    has_token: np.ndarray  # [ceil(vocab_size / 32)] int32: bit v set when id v has a token
    holes: bool  # some id below vocab_size has none (or the tokenizer is wider)
    digits: np.ndarray  # as has_token: bit v set when id v's text is only digits (json_bounds)

    @classmethod
    def build(cls, tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]) -> Vocabulary:
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_str(tokenizer_json)
        size = hf.get_vocab_size(with_added_tokens=True)
        present = np.array([hf.id_to_token(i) is not None for i in range(vocab_size)], bool)
        # an end-of-sequence id without a token (in the padding) cannot end a grammar
        eos_ids = [t for t in eos if 0 <= t < min(size, vocab_size) and present[t]]
        n_vocab = max(vocab_size, size)
        words = -(-vocab_size // 32)
        tokenizer = _llguidance().LLTokenizer(
            tokenizer_json, n_vocab=n_vocab, eos_token=eos_ids or None
        )  # no end-of-sequence id: the tokenizer's own
        digits = np.zeros(vocab_size, bool)  # digits decode as themselves in every scheme
        for text, i in hf.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                digits[i] = json_bounds.digit_only(text.encode())

        def bits(flags: np.ndarray) -> np.ndarray:
            packed = np.packbits(flags, bitorder="little").tobytes().ljust(words * 4, b"\0")
            return np.frombuffer(packed, dtype="<i4").astype(np.int32)

        return cls(
            tokenizer=tokenizer,
            words=-(-n_vocab // 32),
            has_token=bits(present),
            holes=not present.all() or n_vocab > vocab_size,
            digits=bits(digits),
        )

    def first_allowed(self, mask: np.ndarray, eos: list[int]) -> int | None:
        """The lowest id a mask row allows that has a token and does not end the sequence,
        preferring one that is not all whitespace (which JSON allows almost anywhere)."""
        row = mask[: len(self.has_token)] & self.has_token
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        candidates = [int(t) for t in allowed[: len(eos) + 64] if t not in eos]
        spaced = (t for t in candidates if self.tokenizer.decode_bytes([t]).strip())
        return next(spaced, candidates[0] if candidates else None)


class Grammars:
    """Compiled grammars of one tokenizer: checked (for the server's 400s) and turned into
    matchers (for the engine), cached by source, compiled on COMPILE_THREADS threads."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        limits: GrammarLimits | None = None,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.limits = limits or GrammarLimits()
        self._vocab: Vocabulary | None = None
        self._executor: Any = None  # llguidance's, for masks
        self._compiler = ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="neffkit-grammar", initializer=_background
        )
        self._lock = threading.RLock()  # guards the cache (a compile's callback may run inside)
        self._vocab_lock = threading.Lock()  # held while the vocabulary is built (~1 s)
        # key -> a compiled template, the GrammarRefused that refused it, or its compile
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        limits: GrammarLimits | None = None,
    ) -> Grammars | None:
        """The grammars of a bundle's tokenizer (None: it has none, so no constraints)."""
        if tokenizer is None:
            return None
        return cls(tokenizer.to_json(), vocab_size, eos_token_ids, limits)

    @property
    def vocab(self) -> Vocabulary:
        with self._vocab_lock:
            if self._vocab is None:  # ~0.4 s for a 49k vocabulary
                self._vocab = Vocabulary.build(
                    self._tokenizer_json, self.vocab_size, self.eos_token_ids
                )
            return self._vocab

    @property
    def tokenizer(self) -> Any:
        return self.vocab.tokenizer

    # ------------------------------------------------------------ compiling

    def prepare(self, spec: StructuredSpec) -> Future[Any]:
        """The spec's compiled template: done at once if it is cached (or refused), else being
        compiled on a grammar thread. Never blocks on a compile."""
        key = (spec.kind, spec.source, spec.any_whitespace is not False)
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                entry = self._cache[key] = self._compiler.submit(self._compile, spec)
                entry.add_done_callback(lambda done: self._settle(key, done))
            self._cache.move_to_end(key)
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        if isinstance(entry, Future):
            return entry
        done: Future[Any] = Future()
        if isinstance(entry, GrammarRefused):
            done.set_exception(entry)
        else:
            done.set_result(entry)
        return done

    def _settle(self, key: tuple[str, str, bool], done: Future[Any]) -> None:
        """A compile ended: its template, or its refusal, replaces it in the cache (anything
        else, a bug, is raised to its waiters and compiled again next time)."""
        error = done.exception()
        with self._lock:
            if self._cache.get(key) is not done:
                return
            if error is None:
                self._cache[key] = done.result()
            elif isinstance(error, GrammarRefused):
                self._cache[key] = error
            else:
                del self._cache[key]

    def _refuse(self, spec: StructuredSpec, key: tuple[str, str, bool], why: str) -> RequestError:
        """Remember a grammar as refused (its compile may still be running on its thread)."""
        error = GrammarRefused(
            f"the {spec.kind} is too large or too slow to compile: {why}", LIMITS_HINT
        )
        with self._lock:
            if key in self._cache:
                self._cache[key] = error
        return error.of(spec)

    def _compile(self, spec: StructuredSpec) -> Any:
        """A template of the spec's grammar, walked PROBE_TOKENS tokens on a copy (which builds
        the lexer states every copy shares); GrammarRefused if any of it fails."""
        llg = _llguidance()
        try:
            vocab = self.vocab
        except ValueError as exc:  # a tokenizer llguidance cannot read: no grammar works
            why = f"structured outputs cannot use this bundle's tokenizer: {exc}"
            raise GrammarRefused(why) from None
        template = llg.LLMatcher(
            vocab.tokenizer, grammar_text(spec), log_level=0, limits=self.limits.llguidance()
        )
        if template.is_error():
            raise GrammarRefused(f"invalid {spec.kind}: {_first_line(template.get_error())}")
        walker, mask = template.deep_copy(), np.zeros((1, vocab.words), dtype=np.int32)
        eos = list(vocab.tokenizer.eos_tokens)
        for step in range(PROBE_TOKENS + 1):
            llg.numpy.fill_next_token_bitmask(walker, mask, 0)
            if walker.is_error() or step == PROBE_TOKENS:
                break
            token = vocab.first_allowed(mask[0], eos)
            if token is None or not walker.consume_token(token):
                break
        if walker.is_error():
            raise GrammarRefused(
                f"the {spec.kind} is too large or too slow to compile: "
                f"{_first_line(walker.get_error())}",
                LIMITS_HINT,
            )
        return template

    def _template(self, spec: StructuredSpec) -> Any:
        """The compiled template, waiting for it up to the compile deadline."""
        future = self.prepare(spec)
        try:
            return future.result(timeout=self.limits.timeout_s)
        except FutureTimeout:
            key = (spec.kind, spec.source, spec.any_whitespace is not False)
            raise self._refuse(
                spec, key, f"not done within {self.limits.timeout_s:g} s (--grammar-timeout)"
            ) from None
        except GrammarRefused as refused:  # perhaps for a request that named another field
            raise refused.of(spec) from None

    def check(self, spec: StructuredSpec) -> None:
        """RequestError naming the field if the constraint cannot be compiled within the
        limits. Blocks (up to the deadline): the server calls it on a worker thread."""
        self._template(spec)

    def matcher(self, spec: StructuredSpec) -> Any:
        """A request's own matcher at the start of its output (blocking, as `check`); a JSON
        constraint's with its digit run (json_bounds.BoundedMatcher)."""
        matcher = self._template(spec).deep_copy()
        if spec.kind != "json":
            return matcher
        tokenizer = self.vocab.tokenizer
        return json_bounds.BoundedMatcher(matcher, lambda t: tokenizer.decode_bytes([t]))

    # ------------------------------------------------------------ masks

    def fill(self, bitmask: np.ndarray, rows: list[tuple[Any, int]]) -> None:
        """Each (matcher, row)'s next-token mask into `bitmask[row]` ([N, W] int32, C order):
        row by row for a few rows, on llguidance's thread pool for many (a pool's threads cost
        more than a few masks: 8 rows 37 us serially, 181 us pooled, on 2 cores). Ids without a
        token are then cleared."""
        llg, vocab = _llguidance(), self.vocab
        unwrapped, capped = [], []  # llguidance's matchers; rows whose digits ran on
        for matcher, row in rows:
            if isinstance(matcher, json_bounds.BoundedMatcher):
                capped += [row] if matcher.run.capped else []
                matcher = matcher.inner
            unwrapped.append((matcher, row))
        rows = unwrapped
        target = bitmask
        if vocab.words != bitmask.shape[1]:  # a tokenizer wider than the model's vocabulary
            target = np.zeros((bitmask.shape[0], vocab.words), dtype=np.int32)
        if len(rows) < PARALLEL_ROWS:
            for matcher, row in rows:
                llg.numpy.fill_next_token_bitmask(matcher, target, row)
        else:
            if self._executor is None:
                self._executor = llg.LLExecutor()
            llg.numpy.fill_next_token_bitmask_par(self._executor, rows, target)
        if vocab.holes:
            index = [row for _, row in rows]
            bitmask[index] = target[index, : bitmask.shape[1]] & vocab.has_token
        for row in capped:  # a number's digits ran on: digit-only tokens end here
            kept = bitmask[row, : len(vocab.digits)] & ~vocab.digits
            if kept.any():  # (a dead end, say a const of more digits, keeps them)
                bitmask[row, : len(vocab.digits)] = kept
