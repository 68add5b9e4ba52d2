"""Prompt lookup (vLLM's `ngram` speculation): draft tokens from the sequence itself.

The longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred
earlier in the sequence (prompt and output) proposes the tokens that followed its most recent
earlier occurrence. Quoting, editing and summarising prompts repeat their input, so drafts are
often right; no model runs. The search is `bytes.rfind` over the token ids as int32 bytes (C
speed: a step's lookup over a few thousand tokens takes microseconds).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens`; [] without a match."""
    if k <= 0 or len(tokens) < lookup_min + 1:
        return []
    hay = np.asarray(tokens, dtype=np.int32).tobytes()
    count = len(tokens)
    for n in range(min(lookup_max, count - 1), lookup_min - 1, -1):
        pattern = hay[4 * (count - n) :]
        end = 4 * (count - 1)  # an occurrence ending before the suffix's own last token
        while True:
            at = hay.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:  # token-aligned
                start = at // 4 + n
                return list(tokens[start : start + k])
            end = at + len(pattern) - 1
    return []
