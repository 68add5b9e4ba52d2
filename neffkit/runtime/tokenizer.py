"""Text ↔ token ids with the `tokenizers` library (no transformers on the serving path).

Encoding is HF's: `AutoTokenizer(text).input_ids` runs the tokenizer's own post-processor, which
adds BOS where the tokenizer defines it (Llama 3), and so does `encode`. Chat prompts render the
bundle's chat template (`chat_template.jinja`, else `tokenizer_config.json`'s) with the real
`bos_token`/`eos_token` and are encoded without special tokens, as `apply_chat_template` does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from neffkit.errors import BundleError, RequestError

# used when the bundle's tokenizer has no chat template (documented in docs/serving.md)
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json spells it: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class Tokenizer:
    def __init__(
        self, tokenizer: _HFTokenizer, config: dict, chat_template: str | None = None
    ) -> None:
        self._tok = tokenizer
        self.config = config
        self.chat_template = chat_template or config.get("chat_template")
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
        template = path / "chat_template.jinja"  # transformers >= 4.43 saves it beside the config
        return cls(tok, config, template.read_text() if template.exists() else None)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, without padding or truncation (what a grammar
        library builds its token trie from)."""
        tok = _HFTokenizer.from_str(self._tok.to_str())
        tok.no_padding()
        tok.no_truncation()
        return tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, as transformers calls it: the same ids, and it releases the GIL while it
        # works (encode holds it: a prompt of megabytes stalled the server's event loop for
        # seconds even from a worker thread)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def token_id(self, text: str) -> int | None:
        """The id of the one token written `text` (an added token such as `</think>`), if any."""
        found: int | None = self._tok.token_to_id(text)
        return found

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_texts(self, context: list[int], candidates: list[int]) -> list[str]:
        """The text each candidate adds after `context` (a few preceding tokens): a token's text
        with the spaces and merges it has in place, which decoding it alone loses."""
        before = self.decode(context)
        texts = self._tok.decode_batch(
            [[*context, c] for c in candidates], skip_special_tokens=True
        )
        return [
            t[len(before) :] if t.startswith(before) else self.decode([c])
            for t, c in zip(texts, candidates, strict=True)
        ]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]] = (),
        add_generation_prompt: bool = True,
    ) -> str:
        """The conversation as prompt text: the bundle's chat template, else the default; `tools`
        (OpenAI's function definitions) go to the template's own tools support, as HF's
        apply_chat_template passes them. A template that refuses the conversation
        (`raise_exception`) is a RequestError."""
        import jinja2

        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        try:
            return self._template.render(
                messages=messages,
                tools=list(tools) or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=_token_text(self.config.get("bos_token")),
                eos_token=_token_text(self.config.get("eos_token")),
            )
        except jinja2.TemplateError as exc:
            raise RequestError(
                f"the chat template refused the messages: {exc}", param="messages"
            ) from None

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)
