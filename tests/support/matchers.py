"""A grammar matcher for the engine's tests: allows every token, never completes, and records
what it was given (what the scheduler sees of a grammar)."""

from __future__ import annotations


class OpenMatcher:
    def __init__(self) -> None:
        self.consumed: list[int] = []

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return True

    def is_stopped(self) -> bool:
        return False
