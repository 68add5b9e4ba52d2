"""Registry of compile backends: the single list of targets (manifest choices, CLI, errors, tests).

Values are import paths so that reading the registry imports no torch; `get_backend` imports lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neffkit.compile.backends.base import Backend

BACKENDS: dict[str, str] = {  # keys: neffkit.targets.TARGETS (a test checks)
    "cpu": "neffkit.compile.backends.inductor:CpuBackend",
    "cuda": "neffkit.compile.backends.inductor:CudaBackend",
    "neuron": "neffkit.compile.backends.neuron.backend:NeuronBackend",
}


def get_backend(target: str) -> Backend:
    """Instantiate the backend for `target`; unknown names list the available ones."""
    from neffkit.errors import BuildError

    if target not in BACKENDS:
        raise BuildError(f"unknown target {target!r}; available: {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[target].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise BuildError(
            f"target {target!r} is not available in this installation: {exc}",
            hint="each target's installs are in README.md#installs (neuron: docs/neuron.md)",
        ) from exc
    return getattr(module, class_name)()
