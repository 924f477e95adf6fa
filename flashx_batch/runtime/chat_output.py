"""A chat model's answer split into what it holds: the reasoning (`<think>...</think>`), the tool calls, and
the text left for the user — in the format the model's own chat template writes them.

Formats, found in the template's text (`output_format`):
- reasoning: `<think>...</think>` (Qwen3, GLM-4.5 / 4.6, DeepSeek-R1). The answer may open with `<think>`,
  or start inside the thinking when the prompt opened it (DeepSeek-R1), so that only `</think>` shows.
- tool calls, "hermes" (Qwen2.5 / Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- tool calls, "glm" (GLM-4.5 / 4.6): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`,
  a value as text when the tool's parameter is a string, else as JSON (the template writes it that way).
- tool calls, "llama3_json" (Llama-3.1 / 3.3): the whole answer one `{"name": ..., "parameters": {...}}`
  naming one of the row's tools.

Calls are looked for only in rows that offered tools (the row's tools column, or `data.tools`).

A call that cannot be parsed stays in the text and `tool_call_error` says why: never dropped. Calls come out
in OpenAI's shape: `{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

# the tags the formats below are written in: some vocabularies mark them special, and the text parsed then
# keeps them (`Tokenizer.decode_keeping`) where generated_text would skip them
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
           "</arg_value>")


@dataclass(frozen=True)
class OutputFormat:
    reasoning: bool = False
    tool_calls: str | None = None  # "hermes" | "glm" | "llama3_json" | None

    @property
    def parses(self) -> bool:
        return self.reasoning or self.tool_calls is not None


@dataclass
class ParsedOutput:
    content: str  # the answer, without reasoning and without the calls parsed out of it
    reasoning: str | None = None  # None: the answer had no thinking block
    tool_calls: list[dict[str, Any]] | None = None  # None: no call
    tool_call_error: str | None = None  # why a call was left in the text


def output_format(template: str | None) -> OutputFormat:
    """The formats a chat template writes (none for a template without reasoning or tools)."""
    if not template:
        return OutputFormat()
    calls = ("glm" if "<arg_key>" in template else "hermes" if "<tool_call>" in template
             else "llama3_json" if '"parameters"' in template else None)
    return OutputFormat(reasoning="</think>" in template, tool_calls=calls)


def parse(text: str, fmt: OutputFormat, tools: list[dict[str, Any]] | None = None) -> ParsedOutput:
    """`text` split by `fmt`. `tools`: the row's tool definitions (OpenAI shape); calls are parsed only for
    a row that offered tools (an answer that merely looks like a call stays the answer), a "llama3_json"
    call only when it names one of them, and they tell the "glm" format's string parameters from the rest."""
    reasoning, content = split_reasoning(text) if fmt.reasoning else (None, text)
    out = ParsedOutput(content.strip() if reasoning is not None else content, reasoning)
    if not tools:
        return out
    params = _string_params(tools)
    if fmt.tool_calls == "llama3_json":
        _llama3_json(out, set(params))
    elif fmt.tool_calls is not None:
        _tagged_calls(out, fmt.tool_calls, params)
    return out


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer): reasoning None when the text has no thinking block; an unclosed one (cut by
    the token budget) is all reasoning and no answer."""
    stripped = text.lstrip()
    if stripped.startswith("<think>"):
        body = stripped[len("<think>"):]
        reasoning, _, answer = body.partition("</think>")
        return reasoning.strip(), answer
    if "</think>" in text:  # the prompt opened the thinking
        reasoning, _, answer = text.partition("</think>")
        return reasoning.strip(), answer
    return None, text


_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _tagged_calls(out: ParsedOutput, kind: str, string_params: dict[str, set[str]]) -> None:
    calls, errors, kept = [], [], []
    last = 0
    for match in _TAGGED.finditer(out.content):
        call = _hermes(match.group(1)) if kind == "hermes" else _glm(match.group(1), string_params)
        kept.append(out.content[last : match.start()])
        if isinstance(call, str):
            errors.append(call)
            kept.append(match.group(0))  # an unparseable call stays in the text
        else:
            calls.append(call)
        last = match.end()
    rest = out.content[last:]
    if "<tool_call>" in rest:
        errors.append("a <tool_call> block is not closed (cut by the token budget?)")
    kept.append(rest)
    if calls or errors:
        out.content = "".join(kept).strip()
    out.tool_calls = [_openai_call(name, args, i, out.content) for i, (name, args) in enumerate(calls)] or None
    out.tool_call_error = "; ".join(errors) or None


def _hermes(body: str) -> tuple[str, Any] | str:
    try:
        call = json.loads(body)
    except ValueError as exc:
        return f"a <tool_call> is not JSON ({exc})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'a <tool_call> has no "name"'
    args = call.get("arguments", call.get("parameters", {}))
    return call["name"], _json_or_text(args) if isinstance(args, str) else args


def _glm(body: str, string_params: dict[str, set[str]]) -> tuple[str, Any] | str:
    name, _, _ = body.partition("<arg_key>")
    name = name.strip()
    if not name or "\n" in name:
        return "a <tool_call> does not start with the function's name"
    args: dict[str, Any] = {}
    for key, value in _GLM_ARG.findall(body):
        key = key.strip()
        text_param = key in string_params.get(name, set())
        args[key] = value if text_param else _json_or_text(value)
    return name, args


def _llama3_json(out: ParsedOutput, names: set[str]) -> None:
    text = out.content.strip()
    if not text.startswith("{") or not any(f'"{n}"' in text for n in names):
        return
    try:
        call = json.loads(text)
    except ValueError as exc:
        out.tool_call_error = f"the answer looks like a call of a given tool and is not JSON ({exc})"
        return
    if not isinstance(call, dict) or call.get("name") not in names:
        return  # a JSON answer, not a call of a tool the row offered
    args = call.get("parameters", call.get("arguments", {}))
    out.tool_calls, out.content = [_openai_call(call["name"], args, 0, "")], ""


def _openai_call(name: str, args: Any, index: int, context: str) -> dict[str, Any]:
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    digest = hashlib.sha256(f"{index}\x1f{name}\x1f{arguments}\x1f{context}".encode()).hexdigest()[:24]
    return {"id": f"call_{digest}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_or_text(text: str) -> Any:
    """`text` as the JSON value it spells, or the text itself when it spells none."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _string_params(tools: list[dict[str, Any]] | None) -> dict[str, set[str]]:
    """Per function name, its parameters declared `"type": "string"`."""
    out: dict[str, set[str]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {} if isinstance(fn, dict) else {}
        out[fn.get("name", "")] = {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return out
