"""Structured outputs on the host: grammars compiled with llguidance (one of vLLM's two
backends), one matcher per request advanced by each emitted token, and the token bitmask each
step's graph applies before sampling (kernels/logits.py).

A JSON schema, a regex, a list of choices or a Lark / GBNF grammar becomes llguidance's grammar
text once per distinct source (cached); each request gets its own matcher from it. The matcher's
bitmask for the next token is written into the graph's `token_bitmask` rows (bit v % 32 of word
v // 32 allows token v), many rows at once on llguidance's own threads. A grammar that is
complete and allows nothing more ends its request (the scheduler); one that is complete but may
go on allows the end-of-sequence tokens too.

llguidance is imported when the first grammar is compiled: a bundle that never sees one does not
need it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np

from neffkit.errors import RequestError
from neffkit.runtime.sampling_params import StructuredSpec
from neffkit.runtime.tokenizer import Tokenizer

CACHED_GRAMMARS = 256  # distinct grammar sources kept compiled (least recently used dropped)
PARALLEL_ROWS = 16  # constrained rows from which masks are filled on llguidance's threads


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
            options = {"whitespace_flexible": spec.any_whitespace is not False}
            return llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=options)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        return llg.grammar_from({"regex": "regex", "grammar": "grammar"}[spec.kind], spec.source)
    except (ValueError, TypeError) as exc:  # llguidance raises ValueError for bad sources
        raise RequestError(
            f"{spec.field}: cannot compile the {spec.kind}: {exc}", param=spec.field
        ) from None


class Grammars:
    """Compiled grammars of one tokenizer: checked (for the server's 400s) and turned into
    matchers (for the engine), cached by source."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()

    @classmethod
    def of(
        cls, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> Grammars | None:
        """The grammars of a bundle's tokenizer (None: it has none, so no constraints)."""
        if tokenizer is None:
            return None
        return cls(tokenizer.to_json(), vocab_size, eos_token_ids)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:  # ~0.4 s for a 49k vocabulary
            llg = _llguidance()
            self._tokenizer = llg.LLTokenizer(
                self._tokenizer_json,
                n_vocab=self.vocab_size,
                eos_token=list(self.eos_token_ids) or None,  # none: the tokenizer's own
            )
        return self._tokenizer

    def _compiled(self, spec: StructuredSpec) -> Any:
        """A fresh matcher of the spec's grammar, kept as the template of later requests."""
        key = (spec.kind, spec.source, spec.any_whitespace is not False)
        template = self._cache.get(key)
        if template is None:
            llg = _llguidance()
            text = grammar_text(spec)
            template = llg.LLMatcher(self.tokenizer, text, log_level=0)
            if template.is_error():
                raise RequestError(
                    f"{spec.field}: invalid {spec.kind}: {template.get_error()}", param=spec.field
                )
            self._cache[key] = template
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return template

    def check(self, spec: StructuredSpec) -> None:
        """RequestError naming the field if the constraint cannot be compiled."""
        self._compiled(spec)

    def matcher(self, spec: StructuredSpec) -> Any:
        """A request's own matcher at the start of its output."""
        return self._compiled(spec).deep_copy()

    def fill(self, bitmask: np.ndarray, rows: list[tuple[Any, int]]) -> None:
        """Each (matcher, row)'s next-token mask into `bitmask[row]` ([N, W] int32, C order):
        row by row for a few rows, on llguidance's thread pool for many (a pool's threads cost
        more than a few masks: 8 rows 37 us serially, 181 us pooled, on 2 cores)."""
        llg = _llguidance()
        if len(rows) < PARALLEL_ROWS:
            for matcher, row in rows:
                llg.numpy.fill_next_token_bitmask(matcher, bitmask, row)
            return
        if self._executor is None:
            self._executor = llg.LLExecutor()
        llg.numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask)
