"""Text ↔ token ids with the `tokenizers` library (no transformers on the serving path)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from neffkit.errors import BundleError


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, config: dict) -> None:
        self._tok = tokenizer
        self.config = config
        bos = config.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        self.bos_id = tokenizer.token_to_id(bos) if bos and config.get("add_bos_token") else None

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
