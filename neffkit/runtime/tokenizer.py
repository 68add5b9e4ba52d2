"""Text ↔ token ids with the `tokenizers` library (no transformers on the serving path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from neffkit.errors import BundleError

# used when the bundle's tokenizer has no chat template (documented in the README)
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, config: dict) -> None:
        self._tok = tokenizer
        self.config = config
        bos = config.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        self.bos_id = tokenizer.token_to_id(bos) if bos and config.get("add_bos_token") else None
        self._template: Any = None  # compiled on first use

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer | None:
        file = path / "tokenizer.json"
        if not file.exists():
            return None
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise BundleError(f"{file}: cannot load tokenizer: {exc}") from exc
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        return cls(tok, config)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self.config.get("chat_template")

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The conversation as prompt text: the bundle's chat template, else the default."""
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        return self._template.render(
            messages=messages, add_generation_prompt=True, bos_token="", eos_token=""
        )
