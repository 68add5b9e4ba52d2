"""The gated MLP's activations, by the names HF configs give them (`hidden_act`), each computed
as transformers' ACT2FN computes it, so a GELU checkpoint's tokens equal HF's."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # HF's NewGELUActivation, written out (the tanh approximation as GPT-2 computes it)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": F.relu,
}


def gated(name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up."""
    return ACTIVATION_FNS[name](gate) * up
