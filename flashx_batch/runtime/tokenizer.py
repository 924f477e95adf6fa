"""Tokenizer: `tokenizers` for the text, `tokenizer_config.json` for special tokens and chat template.

Created by `Engine.from_pretrained`; the job runner uses it to measure prompt lengths at planning
time. No `transformers` import on this path, so the engine starts fast and works offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from flashx_batch.errors import ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path}: missing. Text prompts need the model's tokenizer.json (a fast tokenizer); "
                "pass token-id lists instead, or save the tokenizer with `save_pretrained`."
            )
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        template_file = Path(model_dir) / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`add_special_tokens=False` for chat-template output, which already spells out BOS and
        role tokens (as transformers' `apply_chat_template(tokenize=True)` does)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat `messages` to the prompt text the model was trained on."""
        if not self.chat_template:
            raise ModelLoadError(
                "this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); "
                "use a prompt column instead of messages, or add a template to the model directory."
            )
        if self._template is None:
            import jinja2  # only chat jobs pay for the import

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise ValueError(message)
