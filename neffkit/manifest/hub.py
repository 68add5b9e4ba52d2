"""`model: org/name` (and `org/name@revision`, a tag, branch or 40-hex commit): a Hugging Face Hub
id resolved to a snapshot directory through `huggingface_hub`, as `vllm serve Qwen/Qwen3-0.6B`
resolves one. The local cache is read first (`HF_HOME`, `HF_HUB_CACHE`); the Hub is asked only
where the cache lacks it and `HF_HUB_OFFLINE` is not set, with the token from the environment
(`HF_TOKEN`). The snapshot's commit is what bundle.json records (`model_revision`), so a bundle
says which weights it was built from and a rebuild of the same commit reads the same directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from neffkit.errors import ManifestError

# org/name[@revision]: the Hub's repo id characters; a revision is a tag, branch or commit
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# what a build reads of a checkpoint (weights, config, tokenizer, chat template)
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo id, revision) if `value` is spelled as a Hub id; None otherwise."""
    match = HUB_ID.match(value)
    if match is None or value.startswith((".", "/", "~")) or value.lower().endswith(".gguf"):
        return None
    return match["repo"], match["revision"]


def resolve(repo: str, revision: str | None, field: str) -> Path:
    """The snapshot directory of `repo` at `revision` (default: main), from the cache or else
    the Hub; a ManifestError naming the id, the cache and why the Hub could not help."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency; a broken install
        raise ManifestError(
            f"{field}: {repo} is a Hub id and huggingface_hub is not installed",
            hint="pip install huggingface_hub, or give a local model directory",
        ) from None
    where, cache = f"{repo}@{revision}" if revision else repo, cache_dir()
    try:
        return Path(
            snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
        )
    except Exception as cached:  # noqa: BLE001 - not in the cache: each library error alike
        missing = f"not in the Hugging Face cache ({cache}: {type(cached).__name__})"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ManifestError(
            f"{field}: {where} is {missing}, and HF_HUB_OFFLINE is set",
            hint=f"download it where the Hub is reachable (hf download {repo}), or unset "
            "HF_HUB_OFFLINE",
        )
    try:
        return Path(
            snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=FILES)
        )
    except Exception as online:  # noqa: BLE001 - network, auth and not-found errors alike
        raise ManifestError(
            f"{field}: {where} is {missing}, and the Hub did not give it: "
            f"{type(online).__name__}: {str(online).splitlines()[0] if str(online) else ''}",
            hint="check the id and revision, the network, and HF_TOKEN for a gated model",
        ) from None


def cache_dir() -> Path:
    """The Hub cache as the environment names it now (huggingface_hub reads it once, at import):
    HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    )
    return Path(home).expanduser() / "hub"


def snapshot_revision(path: Path) -> str | None:
    """The commit of a model directory inside a Hugging Face cache (`.../snapshots/<sha>`)."""
    if path.parent.name == "snapshots" and COMMIT.match(path.name):
        return path.name
    return None
