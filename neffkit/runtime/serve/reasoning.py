"""Reasoning parsers (`neffkit run --reasoning-parser`): a reasoning model's `<think>…</think>`
split from its answer, into chat's `reasoning_content` and `content`, as vLLM's parsers split
them (vllm/reasoning/qwen3_reasoning_parser.py, deepseek_r1_reasoning_parser.py):

- `deepseek_r1`: the output is reasoning until `</think>` (the chat template may have written
  `<think>` into the prompt already; one at the start of the output is dropped), the answer
  after it; without `</think>` it is all reasoning.
- `qwen3`: reasoning only where the output opens with `<think>`; from `</think>` on, the answer.
  Output without `<think>` (thinking turned off) is all answer.

Tool calls are parsed out of the answer only.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole output; None where there is none."""
    if parser == "qwen3" and not text.startswith(START):
        return None, text
    text = text.removeprefix(START)
    if END not in text:
        return text, None
    reasoning, _, answer = text.partition(END)
    return reasoning, answer or None


class ReasoningStream:
    """One choice's streamed text as reasoning and answer deltas: text that could still be the
    start of a tag is held back until the next delta says what it is."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""  # everything so far
        self.mode = "open"  # "open": not decided yet; "reasoning"; "answer"
        self.sent = 0  # characters of text already sent (in either field)

    def feed(self, new: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) text that `new` completes; `final`: nothing is held back."""
        self.text += new
        reasoning = answer = ""
        if self.mode == "open":
            if START.startswith(self.text) and not final:
                return "", ""  # maybe "<think>" still coming
            opens = self.text.startswith(START)
            if self.parser == "qwen3" and not opens:
                self.mode = "answer"
            else:
                self.mode, self.sent = "reasoning", len(START) if opens else 0
        if self.mode == "reasoning":
            end = self.text.find(END, self.sent)
            if end < 0:
                upto = len(self.text) if final else len(self.text) - partial_tag(self.text, END)
                reasoning, self.sent = (
                    self.text[self.sent : max(upto, self.sent)],
                    max(upto, self.sent),
                )
                return reasoning, ""
            reasoning = self.text[self.sent : end]
            self.mode, self.sent = "answer", end + len(END)
        answer, self.sent = self.text[self.sent :], len(self.text)
        return reasoning, answer


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
