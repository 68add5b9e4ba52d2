"""User-facing errors. The CLI turns every NeffkitError into one message, a hint and exit status 2.

Imports nothing from neffkit, so every layer (manifest, compile, bundle, runtime) can raise these.
"""

from __future__ import annotations


class NeffkitError(Exception):
    """An error the user can fix: bad manifest, bundle that does not fit this host, bad request.

    Every one has a hint: the raise site's own where it knows the fix, else its class's
    `default_hint`, the docs page about that kind of error (the CLI prints it as `hint:`).
    """

    default_hint = "common errors and what to do: docs/troubleshooting.md"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.own_hint = hint  # the raise site's; what the server appends to a 4xx message
        self.hint = hint or self.default_hint

    def __str__(self) -> str:
        return self.message if not self.own_hint else f"{self.message}\nhint: {self.own_hint}"


class ManifestError(NeffkitError):
    """The manifest (or the model directory it names) is invalid; the message names the field."""

    default_hint = (
        "every field and its values: docs/manifest.md; common manifest errors: "
        "docs/troubleshooting.md#manifests"
    )


class ModelError(NeffkitError):
    """The HF checkpoint cannot be built into graphs (unsupported architecture, missing tensors).

    `field` names the manifest field the problem concerns, where one does (the manifest re-raises
    the error with that path).
    """

    default_hint = (
        "what each architecture and config field supports: docs/models.md; adding one: "
        "docs/adding-a-model.md"
    )

    def __init__(self, message: str, hint: str | None = None, field: str | None = None) -> None:
        super().__init__(message, hint)
        self.field = field


class BundleError(NeffkitError):
    """A bundle is missing, corrupt, or was built for something this host is not."""

    default_hint = "what to do: docs/troubleshooting.md#loading-and-running"


class RequestError(NeffkitError):
    """A generation request cannot be served by this bundle (too long, bad sampling values).

    `param` names the request field at fault (the OpenAI error body's `param`), where one is.
    """

    default_hint = "what to ask: docs/serving.md#validation-bad-input-never-reaches-a-graph"

    def __init__(self, message: str, hint: str | None = None, param: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param


class BuildError(NeffkitError):
    """A build step failed (trace, compile) for a reason the message explains."""

    default_hint = "what to do: docs/troubleshooting.md#builds"


class AdapterError(NeffkitError):
    """A LoRA adapter this bundle cannot serve (its format, rank or targets); the message names
    the adapter's file or field at fault. The server answers it with 400."""

    default_hint = "what an adapter may be: docs/serving.md#adapters"
