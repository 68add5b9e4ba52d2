"""User-facing errors. The CLI turns every NeffkitError into one message, a hint and exit status 2.

Imports nothing from neffkit, so every layer (manifest, compile, bundle, runtime) can raise these.
"""

from __future__ import annotations


class NeffkitError(Exception):
    """An error the user can fix: bad manifest, bundle that does not fit this host, bad request."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class ManifestError(NeffkitError):
    """The manifest (or the model directory it names) is invalid; the message names the field."""


class ModelError(NeffkitError):
    """The HF checkpoint cannot be built into graphs (unsupported architecture, missing tensors).

    `field` names the manifest field the problem concerns, where one does (the manifest re-raises
    the error with that path).
    """

    def __init__(self, message: str, hint: str | None = None, field: str | None = None) -> None:
        super().__init__(message, hint)
        self.field = field


class BundleError(NeffkitError):
    """A bundle is missing, corrupt, or was built for something this host is not."""


class RequestError(NeffkitError):
    """A generation request cannot be served by this bundle (too long, bad sampling values).

    `param` names the request field at fault (the OpenAI error body's `param`), where one is.
    """

    def __init__(self, message: str, hint: str | None = None, param: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param


class BuildError(NeffkitError):
    """A build step failed (trace, compile) for a reason the message explains."""
