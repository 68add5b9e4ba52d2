"""OpenAI response shapes: a choice's engine events as completion or chat chunks (streamed) and
whole responses, with usage and logprobs as vLLM's OpenAI server emits them."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from neffkit.runtime.engine.core_client import Event
from neffkit.runtime.serve.logprobs import WINDOW, CompletionLogprobs, TokenNamer, chat_logprobs
from neffkit.runtime.serve.protocol import ApiRequest
from neffkit.runtime.serve.reasoning import ReasoningStream, split_reasoning
from neffkit.runtime.serve.tools import ToolStream, finish_reason, parse_calls
from neffkit.runtime.tokenizer import Tokenizer
from neffkit.runtime.worker.step_output import TokenLogprobs

# an OpenAI response body or chunk, built here and sent as JSON as it is
Body = dict[str, Any]


def merge_events(events: list[Event]) -> Event:
    """One choice's events as one: texts, tokens and logprobs joined, the last finish reason."""
    logprobs = [lp for e in events for lp in e.logprobs or ()]
    return replace(
        events[-1],
        text="".join(e.text for e in events),
        token_ids=[t for e in events for t in e.token_ids],
        logprobs=logprobs if any(e.logprobs is not None for e in events) else None,
        prompt_logprobs=next((e.prompt_logprobs for e in events if e.prompt_logprobs), None),
    )


class ChoiceShapes:
    """What completions and chat bodies share: one state per choice, ids of its prompt."""

    def __init__(
        self, tokenizer: Tokenizer | None, parsed: ApiRequest, prompts: list[list[int]]
    ) -> None:
        self.tokenizer, self.parsed, self.prompts = tokenizer, parsed, prompts
        self.logprobs = parsed.params.logprobs is not None
        self._namers: dict[int, TokenNamer] = {}
        self._sent_prompt: set[int] = set()

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.parsed.n]

    def token_ids(self, index: int, e: Event) -> Body:
        """vLLM's `return_token_ids`: the prompt's ids (on a choice's first chunk) and the new
        ones."""
        if not self.parsed.return_token_ids:
            return {}
        first = index not in self._sent_prompt
        self._sent_prompt.add(index)
        prompt: Body = {"prompt_token_ids": list(self.prompt_of(index))} if first else {}
        return {**prompt, "token_ids": list(e.token_ids)}

    def namer(self, index: int, history: list[int]) -> TokenNamer:
        if index not in self._namers:
            tokenizer = None if self.parsed.tokens_as_ids else self.tokenizer
            self._namers[index] = TokenNamer(tokenizer, history[-WINDOW:])
        return self._namers[index]


class CompletionChunks(ChoiceShapes):
    """/v1/completions bodies: plain, streamed chunks, and the usage chunk. With `echo`, a
    choice's first chunk starts with its prompt (and the prompt's logprobs, if asked)."""

    def __init__(
        self, model: str, tokenizer: Tokenizer | None, parsed: ApiRequest, prompts: list[list[int]]
    ) -> None:
        super().__init__(tokenizer, parsed, prompts)
        self.base = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._started: dict[int, CompletionLogprobs] = {}

    def _prompt_text(self, index: int) -> str:
        given = self.parsed.prompts[index // self.parsed.n]
        if isinstance(given, str):
            return given
        return self.tokenizer.decode(given) if self.tokenizer else ""

    def _choice(self, index: int, e: Event) -> Body:
        text, ids = e.text, list(e.token_ids)
        values: list[TokenLogprobs | None] = list(e.logprobs or [])
        if index not in self._started:  # the choice's first chunk
            prompt = self.prompt_of(index)
            echo = self.parsed.echo
            namer = self.namer(index, [] if echo else prompt)
            offset = 0 if echo else len(self._prompt_text(index))
            self._started[index] = CompletionLogprobs(namer, offset)
            if echo:
                text = self._prompt_text(index) + text
                ids = prompt + ids
                given: list[TokenLogprobs | None] = [None] * (len(prompt) - 1)
                values = [None, *(e.prompt_logprobs or given), *values]
        logprobs = self._started[index].add(ids, values) if self.logprobs else None
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": e.finish_reason,
        }
        return choice | self.token_ids(index, e)

    def first(self, index: int) -> Body:
        return {}

    def chunks(self, index: int, e: Event) -> list[Body]:
        return [self.chunk(index, e)]

    def chunk(self, index: int, e: Event) -> Body:
        return {**self.base, "choices": [self._choice(index, e)]}

    def usage(self, usage: Body) -> Body:
        return {**self.base, "choices": [], "usage": usage}

    def whole(self, events: list[Event], usage: Body) -> Body:
        choices = [self._choice(i, e) for i, e in enumerate(events)]
        return {**self.base, "choices": choices, "usage": usage}


class ChatChunks(ChoiceShapes):
    """/v1/chat/completions bodies; the first streamed chunk carries the role, as OpenAI's does.
    With tools, calls are parsed out of the text (tools.py)."""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer | None,
        parsed: ApiRequest,
        prompts: list[list[int]],
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        super().__init__(tokenizer, parsed, prompts)
        self.base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model,
        }
        self.tool_parser = tool_parser  # the server's --tool-call-parser (tool_choice auto)
        self._tool_streams: dict[int, ToolStream] = {}
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (reasoning.py)
        self._reasoning: dict[int, ReasoningStream] = {}

    def _logprobs(self, index: int, e: Event) -> Body | None:
        if not self.logprobs:
            return None
        namer = self.namer(index, self.prompt_of(index))
        return chat_logprobs(namer, list(e.token_ids), list(e.logprobs or []))

    def _delta(
        self, index: int, delta: Body, finish: str | None, logprobs: Body | None = None
    ) -> Body:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self.base, "object": "chat.completion.chunk", "choices": [choice]}

    def first(self, index: int) -> Body:
        return self._delta(index, {"role": "assistant", "content": ""}, None)

    def chunk(self, index: int, e: Event) -> Body:
        delta: Body = {"content": e.text} if e.text else {}
        body = self._delta(index, delta, e.finish_reason, self._logprobs(index, e))
        body["choices"][0] |= self.token_ids(index, e)
        return body

    def chunks(self, index: int, e: Event) -> list[Body]:
        """The streamed bodies of an event: one, or with tools or reasoning, the reasoning,
        content and tool-call deltas it completes (a call's id and name, then its arguments:
        vLLM's order)."""
        req = self.parsed.tool_request
        if req is None and self.reasoning_parser is None:
            return [self.chunk(index, e)]
        deltas, text, finish = [], e.text, e.finish_reason
        if self.reasoning_parser is not None:
            split = self._reasoning.setdefault(index, ReasoningStream(self.reasoning_parser))
            reasoning, text = split.feed(e.text, final=finish is not None)
            deltas += [{"reasoning_content": reasoning}] if reasoning else []
        if req is None:
            deltas += [{"content": text}] if text else []
        else:
            stream = self._tool_streams.setdefault(index, ToolStream(req, self.tool_parser))
            deltas += stream.feed(text)
            if finish is not None:
                more, finish = stream.finish(finish)
                deltas += more
        logprobs = self._logprobs(index, e)
        if not deltas and finish is None and logprobs is None:
            return []
        bodies = [self._delta(index, d, None) for d in deltas] or [self._delta(index, {}, None)]
        last = bodies[-1]["choices"][0]
        last["finish_reason"], last["logprobs"] = finish, logprobs
        last |= self.token_ids(index, e)
        return bodies

    def usage(self, usage: Body) -> Body:
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": usage}

    def _message(self, e: Event) -> tuple[Body, str | None]:
        """A whole choice's message (its reasoning split off, tool calls parsed out of its
        answer) and finish reason."""
        text: str | None = e.text
        extra: Body = {}
        if self.reasoning_parser is not None:
            reasoning, text = split_reasoning(self.reasoning_parser, e.text)
            extra["reasoning_content"] = reasoning
        req = self.parsed.tool_request
        if req is None:
            return {"role": "assistant", "content": text, **extra}, e.finish_reason
        content, calls = parse_calls(req, self.tool_parser, text or "")
        message: Body = {"role": "assistant", "content": content, **extra}
        if calls:
            message["tool_calls"] = calls
        return message, finish_reason(req, calls, e.finish_reason)

    def whole(self, events: list[Event], usage: Body) -> Body:
        choices = []
        for i, e in enumerate(events):
            message, finish = self._message(e)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._logprobs(i, e),
                    "finish_reason": finish,
                }
                | self.token_ids(i, e)
            )
        return {**self.base, "object": "chat.completion", "choices": choices, "usage": usage}
