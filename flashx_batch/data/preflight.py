"""Preflight: read every input file and check what would make the whole job wrong, before anything runs.

Who calls it: `data.plan.build_plan` (driver, planning time). Anything found here raises
`InputError` (exit 2, output untouched) with the file, column or ids in the message; problems
confined to one row are *not* found here — they become error rows in `plan.py`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from flashx_batch.config import DataSection
from flashx_batch.data.readers import Frame, InputFile, read_frame, resolve_inputs
from flashx_batch.job_errors import InputError

log = logging.getLogger(__name__)
_MAX_LISTED = 10
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class LoadedInput:
    """Every input file with its frame, in input order; row refs are (file index, row index)."""

    files: list[InputFile]
    frames: list[Frame]
    id_kind: str  # "int" | "str": the type of the id column, kept in the outputs


def text_column(data: DataSection, task: str = "generate") -> str:
    """The column a row's main text is in: messages or prompt (generate, perplexity), else the context."""
    if task in ("loglikelihood", "multiple_choice"):
        return data.context_column
    return data.messages_column or data.prompt_column


def data_columns(data: DataSection, task: str = "generate", extra: Iterable[str] = ()) -> list[str]:
    """The columns a job reads: id, prompt or messages (and tools), then the passthrough columns; for
    the scoring tasks their context / continuation / choices / answer columns instead of the prompt;
    then `extra` (the per-row sampling columns, `sampling.from_columns`)."""
    tools = [data.tools_column] if data.messages_column and data.tools_column else []
    task_cols = {"loglikelihood": [data.continuation_column],
                 "multiple_choice": [data.choices_column, *([data.answer_column] if data.answer_column else [])],
                 }.get(task, [])
    cols = [data.id_column, text_column(data, task), *task_cols, *tools, *data.passthrough_columns, *extra]
    return list(dict.fromkeys(cols))


def load_inputs(data: DataSection, resolved_path: str, refuse_under: Path | None = None,
                extra_columns: Iterable[str] = (), task: str = "generate") -> LoadedInput:
    """Resolve, read and check the input. Raises InputError; returns the frames for planning.
    `refuse_under` (the job's output directory): an input file found under it is refused before it
    is read, since it is one of the job's own outputs."""
    files = resolve_inputs(resolved_path, data.format)
    if refuse_under is not None:
        mine = [f.path for f in files if refuse_under in Path(f.path).resolve().parents]
        if mine:
            raise InputError(f"data.path={data.path} matches {mine[0]} under output.dir={refuse_under}: every rerun "
                             "would read the job's own outputs as input. Put output.dir outside the input, or "
                             "narrow data.path.")
    cols = data_columns(data, task, extra_columns)  # a missing column: InputError, before the output is touched
    text_col = text_column(data, task)
    frames = [read_frame(f, cols, text_col) for f in files]
    id_kinds = set()
    for f, fr in zip(files, frames, strict=True):
        id_kinds.add(_check_ids(f, fr, data.id_column))
        _check_text_type(f, fr, text_col, messages=bool(data.messages_column))
        if data.messages_column and data.tools_column:
            _check_tools_type(f, fr, data.tools_column)
    if len(id_kinds) > 1:
        raise InputError(f"column {data.id_column!r} is an integer in some files and a string in others; "
                         "make the id type the same everywhere.")
    for c in data.passthrough_columns:
        _check_passthrough(files, frames, c)
    _check_duplicates(files, frames, data.id_column)
    total = sum(fr.num_rows for fr in frames)
    if total == 0:
        raise InputError(f"data.path={resolved_path!r}: the input has no rows.")
    for f, fr in zip(files, frames, strict=True):
        if fr.num_rows == 0:
            log.warning("%s: no rows", f.path)
    return LoadedInput(files, frames, id_kinds.pop() if id_kinds else "str")


def _check_ids(file: InputFile, fr: Frame, col: str) -> str:
    t = fr.types[col]
    if t is not None and not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise InputError(f"{file.path}: column {col!r} has type {t}; ids must be integers or strings.")
    values = fr.columns[col]
    nulls = [i for i, v in enumerate(values) if v is None]
    if nulls:
        raise InputError(f"{file.path}: column {col!r} is null in {len(nulls)} row(s) (row indices "
                         f"{_listed(nulls)}); every row needs an id.")
    kinds = {_id_kind(v) for v in values}
    if len(kinds) > 1 or kinds - {"int", "str"}:
        found = {}
        for i, v in enumerate(values):
            found.setdefault(_id_kind(v), (i, v))
        listed = ", ".join(f"{k} ({v!r} at row {i})" for k, (i, v) in sorted(found.items()))
        if len(kinds) > 1:
            raise InputError(f"{file.path}: column {col!r} mixes types: {listed}; ids must be all integers or all "
                             "strings.")
        raise InputError(f"{file.path}: column {col!r} holds {listed}; ids must be integers or strings: write them "
                         "as one or the other.")
    if "int" in kinds:
        wide = [(i, v) for i, v in enumerate(values) if not _INT64_MIN <= v <= _INT64_MAX]
        if wide:
            i, v = wide[0]
            raise InputError(f"{file.path}: column {col!r} holds {len(wide)} integer id(s) outside the 64-bit range "
                             f"(e.g. {v} at row {i}); Parquet cannot store them as integers. Write the ids as "
                             "strings.")
    if "str" in kinds:
        for i, v in enumerate(values):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(f"{file.path}: column {col!r} at row {i} is not valid UTF-8 text; fix the id "
                                 "(ids are written to Parquet as strings).") from None
    return kinds.pop() if kinds else ("int" if t is not None and pa.types.is_integer(t) else "str")


def _id_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, str):
        return "str"
    return type(v).__name__


def _check_text_type(file: InputFile, fr: Frame, col: str, messages: bool) -> None:
    t = fr.types[col]
    if t is None:
        return  # JSONL: types are checked per row (bad_type error rows)
    ok = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)
    if messages:
        ok = ok or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type))
    else:
        ok = ok or pa.types.is_binary(t) or pa.types.is_large_binary(t)
    if not ok:
        expected = "a list of {role, content} structs or JSON strings" if messages else "strings"
        raise InputError(f"{file.path}: column {col!r} has type {t}; expected {expected}.")


def _check_tools_type(file: InputFile, fr: Frame, col: str) -> None:
    t = fr.types[col]
    if t is None:
        return  # JSONL: checked per row (bad_type error rows)
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)
            or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type))):
        raise InputError(f"{file.path}: column {col!r} (data.tools_column) has type {t}; expected a list of "
                         "function-spec structs or JSON strings.")


def _check_passthrough(files: list[InputFile], frames: list[Frame], col: str) -> None:
    types = set()
    for f, fr in zip(files, frames, strict=True):
        t = fr.types[col]
        if t is None:
            try:
                t = pa.array(fr.columns[col]).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
                raise InputError(f"{f.path}: passthrough column {col!r} mixes value types; it cannot be written "
                                 "to Parquet as one column.") from None
            except UnicodeEncodeError:
                raise InputError(f"{f.path}: passthrough column {col!r} holds text that is not valid UTF-8; it "
                                 "cannot be written to Parquet. Fix the column or drop it from "
                                 "data.passthrough_columns.") from None
        if not pa.types.is_null(t):
            types.add(t)
    if len(types) > 1:
        raise InputError(f"passthrough column {col!r} has different types across files: "
                         f"{', '.join(sorted(map(str, types)))}.")


def _check_duplicates(files: list[InputFile], frames: list[Frame], col: str) -> None:
    counts = Counter(v for fr in frames for v in fr.columns[col])
    dupes = [v for v, n in counts.items() if n > 1]
    if not dupes:
        return
    where = {}
    for f, fr in zip(files, frames, strict=True):
        for v in fr.columns[col]:
            if counts[v] > 1:
                where.setdefault(v, []).append(f.path)
    sample = "; ".join(f"{v!r} in {', '.join(sorted(set(where[v])))}" for v in dupes[:_MAX_LISTED])
    more = f" (and {len(dupes) - _MAX_LISTED} more)" if len(dupes) > _MAX_LISTED else ""
    raise InputError(f"column {col!r} has {len(dupes)} duplicated id(s): {sample}{more}. Ids must be unique.")


def _listed(values: list[Any]) -> str:
    head = ", ".join(map(str, values[:_MAX_LISTED]))
    return head + (", ..." if len(values) > _MAX_LISTED else "")
