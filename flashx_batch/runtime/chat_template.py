"""Chat templates rendered the way transformers' `apply_chat_template(..., tokenize=False)` renders them.

A model's chat template is Jinja source from its directory; the prompt the model was trained on is
whatever transformers makes of it, so this module reproduces transformers' rendering rules (5.x)
without importing transformers:

* the environment: jinja2's `ImmutableSandboxedEnvironment` (templates are untrusted code from a
  model directory) with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension
  (`{% break %}`, `{% continue %}`) and a `{% generation %}` block tag that renders its body unchanged;
* the names a template sees: `tojson` replaced by plain `json.dumps` (no HTML escaping; keyword
  arguments `ensure_ascii=False`, `indent=None`, `separators=None`, `sort_keys=False` by default),
  `raise_exception(msg)`, `strftime_now(fmt)` (the local clock at render time), a `dict()` and a
  `namespace()` that refuses underscore names;
* the variables: `messages`, `tools` (the JSON-schema list, or None), `documents` (None),
  `add_generation_prompt`, the tokenizer's named special tokens (`bos_token`, `eos_token`, ...),
  then any extra keyword arguments (which win over a special token of the same name);
* the data: keys whose value is None dropped from each message, every value rebuilt from plain JSON
  types (anything else becomes the placeholder "<TypeName>"), and a message's reasoning given under
  `reasoning_content` and `thinking` when it came as either of those or as `reasoning`.

tests/unit/test_chat_templates.py pins the rendering against transformers for Qwen3, GLM-4.x and
Llama-3.x templates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Where transformers looks for a message's reasoning, standard name first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The variables a render sets itself; extra template arguments may not reuse them.
RESERVED_NAMES = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplateError(ValueError):
    """The template's own `raise_exception(message)`: the template refuses these messages."""


def render(source: str, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = True, special_tokens: Mapping[str, str] | None = None,
           extra: Mapping[str, Any] | None = None) -> str:
    """`messages` (and `tools`) rendered through the template `source`.

    `special_tokens` are the tokenizer's named special tokens; `extra` the caller's template arguments
    (e.g. `enable_thinking=False`, `date_string="26 Jul 2024"`). Raises ChatTemplateError when the
    template calls raise_exception, other jinja2 / Python errors when it fails on the data."""
    chat = _alias_reasoning([_plain({k: v for k, v in m.items() if v is not None}) for m in messages])
    variables = {**(special_tokens or {}), **_plain(dict(extra or {}))}
    return compile_template(source).render(messages=chat, tools=_plain(tools), documents=None,
                                           add_generation_prompt=add_generation_prompt, **variables)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: a job renders every row through the same one)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _now() -> datetime:
    return datetime.now()


def _strftime_now(fmt: str) -> str:
    return _now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in a template: builds a plain dict, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: `self` may be a keyword
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON types (str, int, float, bool, None, dict, list, tuple); other objects
    become "<TypeName>", so a template never reaches an object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"
