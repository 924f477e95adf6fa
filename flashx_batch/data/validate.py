"""Per-row validation: turns one raw prompt / messages value into prompt text, or an error code.

Who calls it: `data.plan` for every row while planning (rows that fail become error rows, never
reach an engine) and `runner.worker` to rebuild the same prompt text for the rows of its shard.
Both go through `build_prompt`, so the text the plan measured is the text the engine gets.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from flashx_batch.runtime.tokenizer import Tokenizer

# Error codes (`error_code` in errors/; docs/batch_jobs.md "Error rows"); prompt_too_long is decided
# after tokenizing, in plan.py.
NULL_PROMPT = "null_prompt"
EMPTY_PROMPT = "empty_prompt"
BAD_TYPE = "bad_type"
INVALID_TEXT = "invalid_text"
PROMPT_TOO_LONG = "prompt_too_long"
ROW_TOO_LARGE = "row_too_large"
UNRENDERED_MESSAGE = "unrendered_message"
ERROR_CODES = (NULL_PROMPT, EMPTY_PROMPT, BAD_TYPE, INVALID_TEXT, PROMPT_TOO_LONG, ROW_TOO_LARGE, UNRENDERED_MESSAGE)

# C0 controls except tab / newline / carriage return, plus DEL: never meaningful in a document,
# usually the sign of a binary blob or a broken decoder upstream.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class RowProblem:
    code: str
    message: str


def check_text(value: Any, what: str, max_bytes: int) -> str | RowProblem:
    """A raw cell → its text, or the problem with it (null / type / size / encoding / empty)."""
    if value is None:
        return RowProblem(NULL_PROMPT, f"{what} is null")
    if isinstance(value, bytes):  # binary columns: the bytes must be UTF-8
        if len(value) > max_bytes:
            return RowProblem(ROW_TOO_LARGE, f"{what} has {len(value)} bytes, more than data.max_row_bytes={max_bytes}")
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return RowProblem(INVALID_TEXT, f"{what} is not valid UTF-8 (byte {exc.start})")
    if not isinstance(value, str):
        return RowProblem(BAD_TYPE, f"{what} is a {type(value).__name__}, expected a string")
    # len(str) <= UTF-8 bytes <= 4 * len(str): skip the encode for the common, clearly small case
    if len(value) * 4 > max_bytes:
        try:
            size = len(value.encode("utf-8", errors="surrogatepass"))
        except UnicodeEncodeError:
            size = len(value) * 4
        if size > max_bytes:
            return RowProblem(ROW_TOO_LARGE, f"{what} has {size} bytes, more than data.max_row_bytes={max_bytes}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return RowProblem(INVALID_TEXT, f"{what} holds a lone surrogate or undecodable byte at character {exc.start}")
    bad = _CONTROL.search(value)
    if bad:
        return RowProblem(INVALID_TEXT, f"{what} holds control character {bad.group()!r} at character {bad.start()}")
    if not value.strip():
        return RowProblem(EMPTY_PROMPT, f"{what} is empty or whitespace only")
    return value


def check_messages(value: Any, max_bytes: int) -> list[dict[str, str]] | RowProblem:
    """A raw messages cell (list of {role, content}, or its JSON text) → the messages, or the problem."""
    if value is None:
        return RowProblem(NULL_PROMPT, "messages is null")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, an integer past Python's digit limit, too deep
            return RowProblem(BAD_TYPE, "messages is a string that is not JSON (or nests / numbers too large)")
    if not isinstance(value, list):
        return RowProblem(BAD_TYPE, f"messages is a {type(value).__name__}, expected a list of {{role, content}}")
    if not value:
        return RowProblem(EMPTY_PROMPT, "messages is an empty list")
    out, budget = [], max_bytes
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return RowProblem(BAD_TYPE, f"messages[{i}] is not a {{role, content}} object")
        content = check_text(m.get("content"), f"messages[{i}].content", budget)
        if isinstance(content, RowProblem):
            if content.code == EMPTY_PROMPT and m["role"] != "user":
                content = ""  # an empty system turn is legitimate
            else:
                return content
        budget -= len(content)
        out.append({"role": m["role"], "content": content})
    return out


def unrendered_message(messages: list[dict[str, str]], rendered: str) -> RowProblem | None:
    """The first message whose content the template left out of the prompt, as a problem; None if all are in.

    Templates render only the roles they know (`usr`, `tool` and typos vanish without a word), and a
    prompt missing a turn is a different question. Each content is looked for on its own (templates
    may move a system turn, e.g. next to the last user turn); for an assistant turn only the text
    after its last `</think>` counts (reasoning templates drop earlier thinking)."""
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] == "assistant" and "</think>" in content:
            content = content.rsplit("</think>", 1)[1]
        content = content.strip()
        if not content:
            continue
        if content not in rendered:
            return RowProblem(UNRENDERED_MESSAGE, f"messages[{i}] (role {m['role']!r}) does not appear in the prompt "
                                                  "the model's chat template renders; the template leaves that role "
                                                  "out. Use the roles the template knows (system, user, assistant).")
    return None


def build_prompt(prompt: Any, messages: Any, use_messages: bool, prefix: str, max_bytes: int,
                 tokenizer: Tokenizer) -> str | RowProblem:
    """The prompt text of one row (chat template applied for messages, prefix prepended), or its problem."""
    if use_messages:
        checked = check_messages(messages, max_bytes)
        if isinstance(checked, RowProblem):
            return checked
        try:
            text = tokenizer.apply_chat_template(checked)
        except ValueError as exc:  # the template's own raise_exception: e.g. roles out of order
            return RowProblem(BAD_TYPE, f"the chat template rejected the messages: {exc}")
        except Exception as exc:  # a template error on this row's data (jinja2 TemplateError, TypeError)
            return RowProblem(BAD_TYPE, f"the chat template failed on these messages: {type(exc).__name__}: {exc}")
        dropped = unrendered_message(checked, text)
        if dropped is not None:
            return dropped
        return prefix + text
    checked_text = check_text(prompt, "prompt", max_bytes)
    return checked_text if isinstance(checked_text, RowProblem) else prefix + checked_text
