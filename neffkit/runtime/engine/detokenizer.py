"""Incremental, UTF-8-safe detokenization with stop strings, as vLLM does it.

Each step decodes a short window of tokens (`prefix_offset` up to the end) and emits what the
newest tokens added to it, so the work per token stays constant however long the output grows; a
window that ends in an incomplete UTF-8 sequence (U+FFFD) waits for its remaining bytes. Stop
strings are matched across token boundaries: text that could still be the start of a stop string
is held back, and a match cuts the output right before the stop (or right after it, with
`include_stop`), so a streamed answer and a plain one are always the same text.
"""

from __future__ import annotations

from neffkit.runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


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
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window's first token
        self.read_offset = 0  # tokens before this are already part of `text`
        self.text = ""  # everything decoded so far (cut at a stop string once one matched)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def _decode_new(self) -> str:
        """What the tokens after read_offset add to the text ("" while a character is split)."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.ids[self.prefix_offset :])
        if len(window) <= len(before) or window.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(before) :]

    def step(self, new_ids: list[int]) -> str:
        """Add sampled tokens; return the text that may be shown now."""
        if self.stopped:
            return ""
        self.ids += new_ids
        new = self._decode_new()
        self.text += new
        if self.stop and new and len(self.ids) > self.min_tokens:
            cut = self._find_stop(len(new))
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The sequence ended: whatever was held back is now plain text (a split character at
        the very end is shown as U+FFFD, as a full decode would)."""
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

    def _find_stop(self, new_chars: int) -> int | None:
        """Where the output ends if a stop string now occurs (searching only what is new)."""
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - new_chars - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)  # the earliest stop string wins
        return i + len(s) if self.include_stop else i

    def _held_back(self) -> int:
        """Characters at the end that could still grow into a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held
