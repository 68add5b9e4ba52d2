"""Incremental, UTF-8-safe detokenization with stop strings, as vLLM does it.

Each step decodes a short window of tokens (from the first token of the last emitted piece to the
end) and emits what the newest tokens added to it, so the work per token stays constant however
long the output grows; a window that ends in an incomplete UTF-8 sequence (U+FFFD) waits for its
remaining bytes, for up to MAX_PENDING_TOKENS tokens (then the bytes are invalid, not split: a
request that forces byte tokens with logit_bias would otherwise make every step decode its whole
output). Stop strings are matched across token boundaries: text that could still be the start of
a stop string is held back, and a match cuts the output right before the stop (or right after it,
with `include_stop`), so a streamed answer and a plain one are always the same text.

Only a tail of the text is kept: what is held back and the (longest stop - 1) characters a stop
string that ends in the next piece may start in. Each step searches the new text and that tail,
never the whole output (StopStrings), so 64 stop strings of 256 characters cost each token a few
microseconds whether the output is 100 characters or 4 MB.
"""

from __future__ import annotations

from bisect import bisect_left

from neffkit.runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# tokens a window waits for the rest of a split character (4 bytes at most: a few tokens) before
# its U+FFFD is shown, or for a token that adds text at all (special tokens decode to nothing)
MAX_PENDING_TOKENS = 16


class StopStrings:
    """One request's stop strings, sorted once; `scanned` counts the characters the searches
    were given (the unit tests bound it by the new text and the stop set, not the output)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.strings = tuple(sorted({s for s in stop if s}))
        self.longest = max(map(len, self.strings), default=0)
        self.first_chars = frozenset(s[0] for s in self.strings)
        self.scanned = 0

    def __bool__(self) -> bool:
        return bool(self.strings)

    def find(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest stop string in text[start:] (of several at one position, the smallest:
        the shortest, when one extends another): one C-level search per stop string."""
        self.scanned += (len(text) - start) * len(self.strings)
        hits = [(i, s) for s in self.strings if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def held(self, text: str, start: int) -> int:
        """Characters at the end of `text` that could still grow into a stop string: the longest
        suffix beginning at or after `start` that is a proper prefix of one. The stop strings
        that begin with a suffix follow it in sorted order, so each suffix costs one bisect."""
        strings = self.strings
        for p in range(max(start, len(text) - self.longest + 1, 0), len(text)):
            if text[p] not in self.first_chars:
                continue
            tail = text[p:]
            self.scanned += len(tail)
            i = bisect_left(strings, tail)
            # strings[i] is the smallest >= tail: tail itself (not a proper prefix) or, if any
            # stop string extends tail, the first of them; after tail itself, the next one
            if i < len(strings) and strings[i] == tail:
                i += 1
            if i < len(strings) and strings[i].startswith(tail):
                return len(text) - p
        return 0


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # stop strings count only after this many tokens (vLLM)
        self.stop = StopStrings(stop)
        self.include_stop = include_stop
        self.tokens = 0  # tokens seen
        self._ids: list[int] = []  # the decode window: its first token on
        self._read = 0  # tokens of the window already part of the text
        self._text = ""  # the text's tail (what is held back and what a stop may start in)
        self._base = 0  # characters of the text before `_text`
        self.emitted = 0  # characters of the text already handed out
        self._held = 0  # characters the last step held back
        self._searched = False  # stop strings were searched for at an earlier step
        self.stopped = False

    def _decode_new(self, final: bool = False) -> str:
        """What the tokens after the window's read point add to the text: "" while a character
        is split (U+FFFD at the end), all of it when `final`."""
        decode = self.tokenizer.decode
        before = decode(self._ids[: self._read])
        window, end = decode(self._ids), len(self._ids)
        if not final and (len(window) <= len(before) or window.endswith(REPLACEMENT)):
            if end - self._read < MAX_PENDING_TOKENS:
                return ""
            window, end = self._give_up(before)
        self._ids, self._read = self._ids[self._read :], end - self._read
        return window[len(before) :]

    def _give_up(self, before: str) -> tuple[str, int]:
        """MAX_PENDING_TOKENS tokens and still no whole character: the text up to the last of
        the last few token boundaries that ends cleanly (a character split over the tokens
        after it still completes), else all of it, its U+FFFD shown."""
        decode = self.tokenizer.decode
        for end in range(len(self._ids) - 1, len(self._ids) - 4, -1):
            text = decode(self._ids[:end])
            if len(text) > len(before) and not text.endswith(REPLACEMENT):
                return text, end
        return decode(self._ids), len(self._ids)

    def step(self, new_ids: list[int]) -> str:
        """Add sampled tokens; return the text that may be shown now."""
        if self.stopped:
            return ""
        self._ids += new_ids
        self.tokens += len(new_ids)
        new = self._decode_new()
        if not new:  # nothing changed: what may be shown did not either
            return ""
        self._text += new
        stop = self.stop
        if not stop:
            return self._emit(self._base + len(self._text))
        if self.tokens > self.min_tokens:
            # a stop string that ends in the new piece starts in it or in the held-back text; on
            # the first search (min_tokens just reached), anywhere a stop string that ends in it
            # could start, as vLLM searches
            back = self._held if self._searched else stop.longest - 1
            self._searched = True
            hit = stop.find(self._text, max(0, len(self._text) - len(new) - back))
            if hit is not None:
                i, s = hit
                self._text = self._text[: i + len(s) if self.include_stop else i]
                self.stopped = True
                return self._emit(self._base + len(self._text))
        # the new held-back text starts within the last held-back text and the new piece
        self._held = stop.held(self._text, len(self._text) - len(new) - self._held)
        out = self._emit(self._base + len(self._text) - self._held)
        self._trim(stop.longest - 1)
        return out

    def finish(self) -> str:
        """The sequence ended: whatever was held back is now plain text (a split character at
        the very end is shown as U+FFFD, as a full decode would)."""
        if not self.stopped and self._read < len(self._ids):
            self._text += self._decode_new(final=True)
        return self._emit(self._base + len(self._text))

    def _emit(self, upto: int) -> str:
        out = self._text[self.emitted - self._base : upto - self._base]
        self.emitted = max(self.emitted, upto)
        if not self.stop:
            self._trim(0)
        return out

    def _trim(self, keep: int) -> None:
        """Forget the text before its last `keep` characters (none of it is still unshown)."""
        drop = len(self._text) - max(keep, self._base + len(self._text) - self.emitted)
        if drop > 0:
            self._text, self._base = self._text[drop:], self._base + drop
