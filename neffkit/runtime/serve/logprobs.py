"""Logprobs as the OpenAI API returns them, from the graphs' per-token values.

Completions (`logprobs: N`): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a
{token text: logprob} map of the N most likely tokens plus the chosen one, as vLLM returns it) and
`text_offset`; with `echo` the prompt's tokens come first and the very first has none (`null`).
Chat (`logprobs: true, top_logprobs: N`): `{"content": [{token, logprob, bytes, top_logprobs}]}`.
Token texts are what each token adds in place (runtime/tokenizer.py `token_texts`); without a
tokenizer they are `token_id:N`, vLLM's spelling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from neffkit.contract.codec import JsonObject, JsonValue
from neffkit.runtime.tokenizer import Tokenizer
from neffkit.runtime.worker.step_output import TokenLogprobs

WINDOW = 4  # preceding tokens that give a token its in-place text (spaces, merges)
FLOOR = -9999.0  # -inf is not JSON; vLLM reports it as this


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)


@dataclass
class TokenNamer:
    """Token ids → texts, for one sequence read left to right."""

    tokenizer: Tokenizer | None
    history: list[int] = field(default_factory=list)

    def name(self, token: int, alternatives: Sequence[int] = ()) -> list[str]:
        """Texts of `token` and its alternatives at the next position; then `token` is read."""
        ids = [token, *alternatives]
        if self.tokenizer is None:
            texts = [f"token_id:{i}" for i in ids]
        else:
            texts = self.tokenizer.token_texts(self.history[-WINDOW:], ids)
        self.history.append(token)
        return texts


@dataclass
class CompletionLogprobs:
    """The completions `logprobs` object of one choice, grown chunk by chunk."""

    namer: TokenNamer
    offset: int = 0  # text_offset of the next token

    def add(self, ids: list[int], values: Sequence[TokenLogprobs | None]) -> JsonObject:
        """Logprobs of `ids` (None: the prompt's first token, which has no logprob)."""
        tokens: list[JsonValue] = []
        chosen: list[JsonValue] = []
        tops: list[JsonValue] = []
        offsets: list[JsonValue] = []
        for token, lp in zip(ids, values, strict=True):
            texts = self.namer.name(token, lp.top_ids if lp else ())
            tokens.append(texts[0])
            offsets.append(self.offset)
            self.offset += len(texts[0])
            if lp is None:
                chosen.append(None)
                tops.append(None)
                continue
            chosen.append(_finite(lp.logprob))
            top: dict[str, JsonValue] = {
                t: _finite(v) for t, v in zip(texts[1:], lp.top_logprobs, strict=True)
            }
            top.setdefault(texts[0], _finite(lp.logprob))  # the chosen token is always listed
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": chosen,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def chat_logprobs(namer: TokenNamer, ids: list[int], values: list[TokenLogprobs]) -> JsonObject:
    """The chat `logprobs` object for `ids`."""
    content: list[JsonValue] = []
    for token, lp in zip(ids, values, strict=True):
        texts = namer.name(token, lp.top_ids)
        content.append(
            {
                **_entry(texts[0], lp.logprob),
                "top_logprobs": [
                    _entry(t, v) for t, v in zip(texts[1:], lp.top_logprobs, strict=True)
                ],
            }
        )
    return {"content": content}


def _entry(text: str, logprob: float) -> JsonObject:
    return {
        "token": text,
        "logprob": _finite(logprob),
        "bytes": list(text.encode("utf-8", "replace")),
    }
