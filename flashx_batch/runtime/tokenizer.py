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
        self.path = path  # tokenizer.json (the grammar library reads the vocabulary from it)
        self._tok = _HFTokenizer.from_file(str(path))
        # special tokens by id (what decode skips): read once, not per decoded row
        self._specials = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_templates = _chat_templates(Path(model_dir), self.config)
        default = self.chat_templates.get("default")
        self.chat_template: str | None = default if default is not None else (
            next(iter(self.chat_templates.values())) if self.chat_templates else None)
        self.special_tokens = _special_tokens(Path(model_dir), self.config)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None

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

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_among(self, texts: tuple[str, ...]) -> set[str]:
        """Those of `texts` that are special tokens of this vocabulary (decode skips them by default)."""
        specials = set(self._specials.values())
        return {t for t in texts if t in specials}

    def decode_keeping(self, ids: list[int], keep: set[str]) -> str:
        """`decode` with special tokens skipped except those spelled as one of `keep`."""
        specials = self._specials
        return self._tok.decode([i for i in ids if i not in specials or specials[i] in keep], skip_special_tokens=False)

    def template_for(self, tools: list[Any] | None = None) -> str:
        """The template a render uses: the only one, or of several named ones `tool_use` when there are
        tools and the model has one, else `default` (transformers' choice)."""
        if not self.chat_templates:
            raise ModelLoadError(
                "this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); "
                "use a prompt column instead of messages, or add a template to the model directory.")
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise ModelLoadError(f"the model has several chat templates ({', '.join(sorted(self.chat_templates))}) "
                             "and none named default; name one default (chat_template.jinja).")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render chat `messages` to the prompt text the model was trained on: the text transformers'
        `apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False, **kwargs)`
        renders (see runtime/chat_template.py). Raises ChatTemplateError (a ValueError) when the
        template refuses the messages."""
        from flashx_batch.runtime import chat_template  # only chat jobs pay for the jinja2 import

        return chat_template.render(self.template_for(tools), messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, extra=kwargs)


def _chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """The model's chat templates by name, found where transformers finds them: chat_template.jinja
    (`default`) and additional_chat_templates/NAME.jinja, which replace any in tokenizer_config.json;
    else tokenizer_config.json's `chat_template` (one string = `default`, or a list of {name, template})."""
    files: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        files["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        files.update({f.name.removesuffix(".jinja"): f.read_text(encoding="utf-8")
                      for f in sorted(extra_dir.glob("*.jinja"))})
    if files:
        return files
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t and "template" in t}
    return {}


# The named special tokens every tokenizer has (transformers' SPECIAL_TOKENS_ATTRIBUTES), in its order.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named special token -> its text, as transformers' `special_tokens_map` has them (chat templates
    see these as variables): the standard names, then the model's own `*_token` keys and the named
    `extra_special_tokens`. A legacy special_tokens_map.json counts when the config lists no
    `added_tokens_decoder` (transformers reads it only then)."""
    values = dict(config)
    legacy = model_dir / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        values.update(json.loads(legacy.read_text(encoding="utf-8")))
    out = {k: _token_text(values.get(k)) for k in _SPECIAL_TOKENS}
    for key, value in values.items():
        if key.endswith("_token") and key not in out and isinstance(_token_text(value), str):
            out[key] = _token_text(value)
    extra = values.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update({k: _token_text(v) for k, v in extra.items() if isinstance(_token_text(v), str)})
    return {k: v for k, v in out.items() if isinstance(v, str)}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value
