"""Per-row validation: turns one raw prompt / messages value into prompt text, or an error code.

Who calls it: `data.plan` for every row while planning (rows that fail become error rows, never
reach an engine) and `runner.worker` to rebuild the same prompt text for the rows of its shard.
Both go through `build_prompt`, so the text the plan measured is the text the engine gets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flashx_batch.config_schema import DataSection
from flashx_batch.data.row_values import describe
from flashx_batch.runtime.lm_requests import LMEncoder
from flashx_batch.runtime.tokenizer import Tokenizer

# Error codes (`error_code` in errors/; docs/batch_jobs.md "Error rows"); prompt_too_long is decided
# after tokenizing, in plan.py; bad_sampling_param (per-row sampling columns) in data/row_sampling.py.
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


def check_messages(value: Any, max_bytes: int) -> list[dict[str, Any]] | RowProblem:
    """A raw messages cell (list of message objects, or its JSON text) → the messages, or the problem.

    A message is {role, content} plus the optional fields chat templates read: `tool_calls` on an
    assistant turn (a list of {function: {name, arguments}}, or {name, arguments}; arguments an object
    or its JSON text), `reasoning_content` / `thinking` / `reasoning`, `name`, `tool_call_id`; other
    keys pass through untouched. As in transformers, keys whose value is null are dropped; an empty
    `tool_calls` list counts as none (columnar files write one for every turn)."""
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
    out: list[dict[str, Any]] = []
    budget = max_bytes
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return RowProblem(BAD_TYPE, f"messages[{i}] is not a {{role, content}} object")
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls") == []:
            del m["tool_calls"]
        role = m["role"]
        if "tool_calls" in m:
            if role != "assistant":
                return RowProblem(BAD_TYPE, f"messages[{i}] (role {role!r}) has tool_calls; only assistant turns "
                                            "call tools")
            calls = _check_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if isinstance(calls, RowProblem):
                return calls
            budget -= calls
        if "content" in m or "tool_calls" not in m:  # an assistant turn with tool calls may leave content out
            content = check_text(m.get("content"), f"messages[{i}].content", budget)
            if isinstance(content, RowProblem):
                if content.code == EMPTY_PROMPT and role != "user":
                    content = m["content"] if isinstance(m["content"], str) else ""  # an empty system /
                    # assistant / tool turn is legitimate
                elif content.code == NULL_PROMPT:
                    return RowProblem(NULL_PROMPT, f"messages[{i}].content is missing or null; give the turn's "
                                                   "text (an assistant turn may leave it out only with tool_calls)")
                elif content.code == BAD_TYPE:
                    return RowProblem(BAD_TYPE, content.message + " (message content is text)")
                else:
                    return content
            m["content"] = content
            budget -= len(content)
        for key in _TEXT_FIELDS:
            if key in m:
                text = check_text(m[key], f"messages[{i}].{key}", budget)
                if isinstance(text, RowProblem) and text.code != EMPTY_PROMPT:
                    return text
                m[key] = m[key] if isinstance(text, RowProblem) else text
                budget -= len(m[key])
        out.append(m)
    return out


# Optional message fields that must be text when present (templates concatenate them).
_TEXT_FIELDS = ("reasoning_content", "thinking", "reasoning", "name", "tool_call_id")


def _check_tool_calls(calls: Any, what: str) -> int | RowProblem:
    """An assistant turn's tool calls: their size in characters, or the problem with them."""
    if not isinstance(calls, list):
        return RowProblem(BAD_TYPE, f"{what} is a {type(calls).__name__}, expected a list of "
                                    "{function: {name, arguments}}")
    size = 0
    for j, call in enumerate(calls):
        where = f"{what}[{j}]"
        if not isinstance(call, dict):
            return RowProblem(BAD_TYPE, f"{where} is not an object; give {{function: {{name, arguments}}}}")
        fn = call.get("function", call)  # OpenAI shape, or the bare {name, arguments}
        if not isinstance(fn, dict):
            return RowProblem(BAD_TYPE, f"{where}.function is not an object; give {{name, arguments}}")
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            return RowProblem(BAD_TYPE, f"{where} has no function name; give function.name as a string")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):
                return RowProblem(BAD_TYPE, f"{where} ({fn['name']!r}): arguments is a string that is not JSON; "
                                            "give an object or its JSON text")
            if not isinstance(parsed, dict):
                return RowProblem(BAD_TYPE, f"{where} ({fn['name']!r}): arguments is JSON but not an object")
            size += len(args)
        elif isinstance(args, dict):
            size += len(json.dumps(args, default=str))
        else:
            return RowProblem(BAD_TYPE, f"{where} ({fn['name']!r}): arguments is "
                                        f"{'missing' if args is None else 'a ' + type(args).__name__}; give an "
                                        "object ({} for none) or its JSON text")
    return size


def check_tools(value: Any, max_bytes: int, what: str = "tools") -> list[dict[str, Any]] | None | RowProblem:
    """A tools cell (a list of JSON-schema function specs, or its JSON text) → the list (None: no tools,
    for null or an empty list), or the problem. A spec is {type: function, function: {name, description,
    parameters}} or the bare {name, description, parameters}; other keys pass through."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > max_bytes:
            return RowProblem(ROW_TOO_LARGE, f"{what} has more than data.max_row_bytes={max_bytes} characters")
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return RowProblem(BAD_TYPE, f"{what} is a string that is not JSON; give a list of function specs")
    if not isinstance(value, list):
        return RowProblem(BAD_TYPE, f"{what} is a {type(value).__name__}, expected a list of "
                                    "{type: function, function: {name, parameters}}")
    for j, tool in enumerate(value):
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"].strip():
            return RowProblem(BAD_TYPE, f"{what}[{j}] is not a function spec; give "
                                        "{type: function, function: {name, description, parameters}}")
        if "parameters" in spec and spec["parameters"] is not None and not isinstance(spec["parameters"], dict):
            return RowProblem(BAD_TYPE, f"{what}[{j}] ({spec['name']!r}): parameters is not a JSON-schema object")
    if len(json.dumps(value, default=str)) > max_bytes:
        return RowProblem(ROW_TOO_LARGE, f"{what} has more than data.max_row_bytes={max_bytes} characters")
    return value or None


def unrendered_message(messages: list[dict[str, Any]], rendered: str) -> RowProblem | None:
    """The first message whose content (or tool call) the template left out of the prompt, as a problem;
    None if all are in.

    Templates render only the roles they know (`usr` and typos vanish without a word; some templates
    have no `tool` role or drop tool calls), and a prompt missing a turn is a different question. Each
    content is looked for on its own (templates may move a system turn, e.g. next to the last user
    turn), as written or JSON-quoted (Llama-3.x writes tool results with `tojson`); for an assistant
    turn only the text after its last `</think>` counts (reasoning templates drop earlier thinking),
    and each tool call must show its function name."""
    for i, m in enumerate(messages):
        content = m.get("content", "")
        if m["role"] == "assistant" and "</think>" in content:
            content = content.rsplit("</think>", 1)[1]
        content = content.strip()
        if content and not any(c in rendered for c in (content, json.dumps(content, ensure_ascii=False)[1:-1],
                                                        json.dumps(content)[1:-1])):
            return RowProblem(UNRENDERED_MESSAGE, f"messages[{i}] (role {m['role']!r}) does not appear in the prompt "
                                                  "the model's chat template renders; the template leaves that turn "
                                                  "out. Use the roles the template knows (system, user, assistant, "
                                                  "and tool where it has one).")
        for j, call in enumerate(m.get("tool_calls", ())):
            name = call.get("function", call)["name"]
            if name not in rendered:
                return RowProblem(UNRENDERED_MESSAGE, f"messages[{i}].tool_calls[{j}] (function {name!r}) does not "
                                                      "appear in the prompt the model's chat template renders; this "
                                                      "template does not render tool calls.")
    return None


def row_tools(data: DataSection, columns: Mapping[str, list[Any]], row: int) -> Any:
    """The tools cell of `row`: its data.tools_column value when the job names one, else the job's data.tools."""
    return columns[data.tools_column][row] if data.tools_column else (list(data.tools) or None)


def build_prompt(prompt: Any, messages: Any, use_messages: bool, prefix: str, max_bytes: int,
                 tokenizer: Tokenizer, tools: Any = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> str | RowProblem:
    """The prompt text of one row (chat template applied for messages, prefix prepended), or its problem.

    `tools`: the row's tools cell (data.tools_column) or the job's data.tools; `template_kwargs`:
    data.chat_template_kwargs, extra variables for the template."""
    if use_messages:
        checked = check_messages(messages, max_bytes)
        if isinstance(checked, RowProblem):
            return checked
        tool_list = check_tools(tools, max_bytes)
        if isinstance(tool_list, RowProblem):
            return tool_list
        try:
            text = tokenizer.apply_chat_template(checked, tools=tool_list, **(template_kwargs or {}))
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


# ---- scoring tasks (task: loglikelihood | multiple_choice | perplexity) -------------------------
EMPTY_CONTEXT = "empty_context"
NULL_CONTEXT = "null_context"
NULL_CONTINUATION = "null_continuation"
EMPTY_CONTINUATION = "empty_continuation"
CONTINUATION_TOO_LONG = "continuation_too_long"
NULL_CHOICES = "null_choices"
EMPTY_CHOICES = "empty_choices"
EMPTY_CHOICE = "empty_choice"
ANSWER_OUT_OF_RANGE = "answer_out_of_range"
TASK_ERROR_CODES = (EMPTY_CONTEXT, NULL_CONTEXT, NULL_CONTINUATION, EMPTY_CONTINUATION, CONTINUATION_TOO_LONG,
                    NULL_CHOICES, EMPTY_CHOICES, EMPTY_CHOICE, ANSWER_OUT_OF_RANGE)


@dataclass(frozen=True)
class ScoreRow:
    """One row of a scoring task, checked: the texts to score (the context with data.prompt_prefix)."""

    context: str = ""
    continuation: str = ""  # loglikelihood
    choices: tuple[str, ...] = ()  # multiple_choice
    answer: int | None = None  # multiple_choice (None: no answer given)
    text: str = ""  # perplexity


def _field(value: Any, column: str, field: str, max_bytes: int) -> str | RowProblem:
    """A text cell of a scoring row: check_text's problems, renamed for the field (null_context, ...)."""
    text = check_text(value, f"{field} (column {column!r})", max_bytes)
    if isinstance(text, RowProblem) and text.code in (NULL_PROMPT, EMPTY_PROMPT):
        return RowProblem(text.code.replace("prompt", field), text.message)
    return text


def score_row(task: str, data: DataSection, columns: Mapping[str, list[Any]], row: int) -> ScoreRow | RowProblem:
    """The checked row of a scoring task, or its problem. An empty-string context is allowed (the model
    then conditions on the prefix token, as lm-eval does); null, whitespace-only or non-text cells are not."""
    limit = data.max_row_bytes
    if task == "perplexity":
        text = check_text(columns[data.prompt_column][row], "text", limit)
        return text if isinstance(text, RowProblem) else ScoreRow(text=text)
    raw = columns[data.context_column][row]
    context = "" if raw == "" else _field(raw, data.context_column, "context", limit)
    if isinstance(context, RowProblem):
        return context
    context = data.prompt_prefix + context
    if task == "loglikelihood":
        cont = _field(columns[data.continuation_column][row], data.continuation_column, "continuation", limit)
        return cont if isinstance(cont, RowProblem) else ScoreRow(context=context, continuation=cont)
    choices = columns[data.choices_column][row]
    where = f"choices (column {data.choices_column!r})"
    if choices is None:
        return RowProblem(NULL_CHOICES, f"{where} is null")
    if isinstance(choices, str):
        try:
            choices = json.loads(choices)
        except (ValueError, RecursionError):
            return RowProblem(BAD_TYPE, f"{where} is a string that is not JSON; give a list of strings")
    if not isinstance(choices, (list, tuple)):
        return RowProblem(BAD_TYPE, f"{where} is a {type(choices).__name__}, expected a list of strings")
    if not choices:
        return RowProblem(EMPTY_CHOICES, f"{where} is an empty list")
    checked = []
    for j, choice in enumerate(choices):
        text = check_text(choice, f"{where}[{j}]", limit)
        if isinstance(text, RowProblem):
            code = {NULL_PROMPT: EMPTY_CHOICE, EMPTY_PROMPT: EMPTY_CHOICE}.get(text.code, text.code)
            return RowProblem(code, text.message)
        checked.append(text)
    answer = columns[data.answer_column][row] if data.answer_column else None
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, int):
            return RowProblem(BAD_TYPE, f"answer (column {data.answer_column!r}) is a {type(answer).__name__}, "
                                        "expected the index of the right choice (an integer)")
        if not 0 <= answer < len(checked):
            return RowProblem(ANSWER_OUT_OF_RANGE, f"answer (column {data.answer_column!r}) is {describe(answer)}, "
                                                   f"outside 0..{len(checked) - 1} for {len(checked)} choices")
    return ScoreRow(context=context, choices=tuple(checked), answer=answer)


@dataclass(frozen=True)
class EncodedRow:
    """A scoring row as token ids (lm-eval's rules, runtime.lm_requests): `pairs` (context, continuation)
    — one for loglikelihood, one per choice for multiple_choice — or the text's `tokens` (perplexity);
    `length`: the tokens the model reads for it (the plan buckets by it)."""

    pairs: tuple[tuple[list[int], list[int]], ...] = ()
    tokens: tuple[int, ...] = ()
    length: int = 0
    truncated: bool = False  # the context was cut to its last tokens to fit max_input_len (`long_input=truncate`)


def encode_score_rows(task: str, rows: list[ScoreRow], encoder: LMEncoder, max_len: int,
                      delimiter: str = " ", long_input: str = "truncate") -> list[EncodedRow | RowProblem]:
    """Encode checked scoring rows as the engine will score them; rows that cannot be scored (a context or
    continuation with no tokens, a continuation longer than max_len tokens) become problems. A context
    too long for max_len with its continuation (lm-eval scores such a pair on its last tokens) is a
    `prompt_too_long` problem under `long_input=error`, else scored so and flagged `truncated`.
    Perplexity never cuts: a text is scored in disjoint windows."""
    if task == "perplexity":
        out: list[EncodedRow | RowProblem] = []
        for ids in encoder.encode([r.text for r in rows]):
            out.append(EncodedRow(tokens=tuple(ids), length=min(len(ids), max_len)) if ids else
                       RowProblem(EMPTY_PROMPT, "text has no tokens"))
        return out
    if task == "loglikelihood":
        flat = [(r.context, r.continuation) for r in rows]
        sizes = [1] * len(rows)
    else:
        flat = [(r.context, delimiter + c) for r in rows for c in r.choices]
        sizes = [len(r.choices) for r in rows]
    encoded = encoder.pairs([c for c, _ in flat], [x for _, x in flat])
    out, o = [], 0
    for n in sizes:
        pairs = encoded[o : o + n]
        o += n
        out.append(_encoded(task, pairs, max_len, long_input == "error"))
    return out


def _encoded(task: str, pairs: list[tuple[list[int], list[int]]], max_len: int, cut_is_error: bool
             ) -> EncodedRow | RowProblem:
    what = "the continuation" if task == "loglikelihood" else "choice {j}"
    for j, (ctx, cont) in enumerate(pairs):
        if not ctx:
            return RowProblem(EMPTY_CONTEXT, "the context has no tokens (whitespace only); give some text, or an "
                                             "empty string to condition on the prefix token")
        if not cont:
            return RowProblem(EMPTY_CONTINUATION if task == "loglikelihood" else EMPTY_CHOICE,
                              f"{what.format(j=j)} has no tokens")
        if len(cont) > max_len:
            return RowProblem(CONTINUATION_TOO_LONG, f"{what.format(j=j)} has {len(cont)} tokens, more than "
                                                     f"runtime.max_input_len={max_len}")
    # the model reads ctx + cont minus its last token: past max_len, lm-eval's `fit` keeps the last max_len
    longest = max(len(ctx) + len(cont) - 1 for ctx, cont in pairs)
    if longest > max_len and cut_is_error:
        pair = "its continuation" if task == "loglikelihood" else "a choice"
        return RowProblem(PROMPT_TOO_LONG, f"the context with {pair} is {longest} tokens, more than "
                                           f"runtime.max_input_len={max_len} "
                                           "(runtime.long_input=error); raise max_input_len, or set "
                                           "long_input=truncate to score it on its last tokens (flagged truncated)")
    if task == "loglikelihood":
        ctx, cont = pairs[0]
        length = min(len(ctx) + len(cont) - 1, max_len)
    else:
        length = len(pairs[0][0]) + sum(len(c) - 1 for _, c in pairs)
    return EncodedRow(pairs=tuple(pairs), length=length, truncated=longest > max_len)
