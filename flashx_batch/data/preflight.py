"""Preflight: read every input file and check what would make the whole job wrong, before anything runs.

Who calls it: `runner.job.plan_job` (driver, planning time). Anything found here raises
`InputError` (exit 2, output untouched) with the file, column or ids in the message; problems
confined to one row are *not* found here — they become error rows in `plan.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from flashx_batch.config_schema import DataSection
from flashx_batch.data.readers import Frame, InputFile, MissingColumns, iter_frames, read_frame, resolve_inputs
from flashx_batch.job_errors import InputError

log = logging.getLogger(__name__)
_MAX_LISTED = 10
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
CHUNK_ROWS = 65536  # rows decoded at once while checking and planning


@dataclass
class LoadedInput:
    """The checked input: its files in input order (row refs are (file index, row index)), the id
    type, and the passthrough columns' types. No rows are held: the planner streams them with
    `chunks`, workers re-read the rows of their shard."""

    files: list[InputFile]
    id_kind: str  # "int" | "str": the type of the id column, kept in the outputs
    columns: list[str] = field(default_factory=list)
    text_column: str = "prompt"
    num_rows: int = 0
    passthrough_types: dict[str, pa.DataType] = field(default_factory=dict)
    passthrough: list[str] = field(default_factory=list)  # the columns copied to the output, as found

    def chunks(self, batch_rows: int = CHUNK_ROWS) -> Iterator[tuple[int, int, Frame]]:
        """(file index, first row index, frame of up to `batch_rows` rows), in input order."""
        for fi, f in enumerate(self.files):
            offset = 0
            for fr in iter_frames(f, self.columns, self.text_column, batch_rows):
                yield fi, offset, fr
                offset += fr.num_rows

    @property
    def frames(self) -> list[Frame]:
        """Every file read whole (small inputs, tests); planning streams `chunks` instead."""
        return [read_frame(f, self.columns, self.text_column) for f in self.files]


def prompt_roles(data: DataSection) -> dict[str, str]:
    """The text columns of a prompted row (task=generate, and the default of `load_inputs`): the prompt or
    messages column (and the tools column of chat rows), each with the setting that names it."""
    roles = {data.messages_column: "data.messages_column"} if data.messages_column else \
        {data.prompt_column: "data.prompt_column"}
    if data.messages_column and data.tools_column:
        roles.setdefault(data.tools_column, "data.tools_column")
    return roles


def column_roles(data: DataSection, own: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The columns a job reads, each with the setting that names it: the id, the task's `own` columns, the
    passthrough columns, then `extra` (per-row sampling columns, eval references).
    `data.passthrough_if_present` is not here: `load_inputs` keeps those the input has."""
    roles = {data.id_column: "data.id_column"}
    for c, key in [*own.items(), *((c, "data.passthrough_columns") for c in data.passthrough_columns)]:
        roles.setdefault(c, key)
    for c, key in (extra or {}).items():
        roles.setdefault(c, key)
    return roles


def missing_columns_message(exc: MissingColumns, roles: Mapping[str, str]) -> str:
    """`exc`'s message with the setting that asked for each missing column and how to change it."""
    def fix(column: str) -> str:
        key = roles.get(column, "the job")
        if key == "data.passthrough_columns":
            return (f"{column!r} (data.passthrough_columns asks for it: add the column, or leave it out with "
                    f"data.passthrough_columns=[...] without it, or name it in data.passthrough_if_present to copy "
                    f"it only where it exists)")
        if key.startswith("data.") and key.endswith("_column"):
            return f"{column!r} (named by {key}: add the column, or point {key}=<your column> at it)"
        return f"{column!r} (named by {key})"

    return (f"{exc.path}: missing column(s) {', '.join(fix(c) for c in exc.missing)}; it has "
            f"{', '.join(exc.present) or 'none'}.")


def load_inputs(data: DataSection, resolved_path: str, refuse_under: Path | None = None,
                roles: Mapping[str, str] | None = None, text_col: str | None = None) -> LoadedInput:
    """Resolve and check the input, streaming each file in chunks (memory grows with a chunk and
    the ids, not with the prompts). Raises InputError. `refuse_under` (the job's output directory):
    an input file found under it is refused before it is read, since it is one of the job's own outputs.
    `roles`: the columns to read with the settings naming them (`tasks.read_columns`; default: a prompted
    row's), `text_col` the row's main text (default: the prompt or messages column).
    `data.passthrough_if_present` columns are read where every file has them; `LoadedInput.passthrough`
    says which were."""
    files = resolve_inputs(resolved_path, data.format)
    if refuse_under is not None:
        mine = [f.path for f in files if refuse_under in Path(f.path).resolve().parents]
        if mine:
            raise InputError(f"data.path={data.path} matches {mine[0]} under output.dir={refuse_under}: every rerun "
                             "would read the job's own outputs as input. Put output.dir outside the input, or "
                             "narrow data.path.")
    roles = roles if roles is not None else column_roles(data, prompt_roles(data))
    text_col = text_col or next(iter(prompt_roles(data)))
    # copied as well when the job reads it for another role (a reference or answer column, say)
    optional = [c for c in dict.fromkeys(data.passthrough_if_present)
                if c not in data.passthrough_columns and c != data.id_column]
    while True:  # an optional column some file lacks is dropped, and the files are checked again without it
        try:
            return _load(data, resolved_path, files, roles, optional, text_col)
        except MissingColumns as exc:
            absent = [c for c in exc.missing if c in optional]
            if not absent:
                raise InputError(missing_columns_message(exc, roles)) from None
            log.info("%s has no column %s: data.passthrough_if_present skips it for this job", exc.path,
                     ", ".join(absent))
            optional = [c for c in optional if c not in absent]


def _load(data: DataSection, resolved_path: str, files: list[InputFile], roles: Mapping[str, str],
          optional: list[str], text_col: str) -> LoadedInput:
    cols = list(dict.fromkeys([*roles, *optional]))  # a missing column: InputError, before the output is touched
    carried = [*data.passthrough_columns, *optional]
    # the checks read values of the id and passthrough columns only; every column's type comes along
    valued = [data.id_column, *carried]
    id_kinds = set()
    ids: list[pa.Array] = []  # per file, compact: the duplicate check
    passthrough: dict[str, dict[pa.DataType, str]] = {c: {} for c in carried}
    total = 0
    for f in files:
        offset, kinds, file_ids = 0, set(), []
        for fr in iter_frames(f, cols, text_col, values=valued):
            kinds.add(_check_ids(f, fr, data.id_column, offset))
            _check_text_type(f, fr, text_col, messages=bool(data.messages_column))
            if data.messages_column and data.tools_column:
                _check_tools_type(f, fr, data.tools_column)
            for c in carried:
                t = _passthrough_type(f, fr, c)
                if t is not None:
                    passthrough[c].setdefault(t, f.path)
            file_ids.append(pa.array(fr.columns[data.id_column]) if fr.num_rows else pa.array([], pa.null()))
            offset += fr.num_rows
        kinds.discard("empty")
        if len(kinds) > 1:
            raise InputError(f"{f.path}: column {data.id_column!r} mixes integer and string ids across its rows; "
                             "ids must be all integers or all strings.")
        id_kinds |= kinds
        ids.append(_concat(file_ids))
        total += offset
        if offset == 0:
            log.warning("%s: no rows", f.path)
    if len(id_kinds) > 1:
        raise InputError(f"column {data.id_column!r} is an integer in some files and a string in others; "
                         "make the id type the same everywhere.")
    for c, types in passthrough.items():
        if len(types) > 1:
            raise InputError(f"passthrough column {c!r} has different types across files: "
                             f"{', '.join(sorted(map(str, types)))}.")
    _check_duplicates(files, ids, data.id_column)
    if total == 0:
        raise InputError(f"data.path={resolved_path!r}: the input has no rows.")
    return LoadedInput(files, id_kinds.pop() if id_kinds else "str", cols, text_col, total,
                       {c: next(iter(t)) for c, t in passthrough.items() if t}, carried)


def _concat(arrays: list[pa.Array]) -> pa.Array:
    arrays = [a for a in arrays if len(a)]
    if not arrays:
        return pa.array([], pa.null())
    if len(arrays) == 1:
        return arrays[0]
    common = pa.string() if any(pa.types.is_string(a.type) or pa.types.is_large_string(a.type) for a in arrays) \
        else pa.int64()
    return pa.concat_arrays([a.cast(common) for a in arrays])


def _check_ids(file: InputFile, fr: Frame, col: str, offset: int = 0) -> str:
    """The id kind of one chunk of a file ("empty" for no rows); `offset`: the chunk's first row."""
    t = fr.types[col]
    if t is not None and not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise InputError(f"{file.path}: column {col!r} has type {t}; ids must be integers or strings.")
    values = fr.columns[col]
    nulls = [offset + i for i, v in enumerate(values) if v is None]
    if nulls:
        raise InputError(f"{file.path}: column {col!r} is null in {len(nulls)} row(s) (row indices "
                         f"{_listed(nulls)}); every row needs an id.")
    kinds = {_id_kind(v) for v in values}
    if len(kinds) > 1 or kinds - {"int", "str"}:
        found = {}
        for i, v in enumerate(values):
            found.setdefault(_id_kind(v), (offset + i, v))
        listed = ", ".join(f"{k} ({v!r} at row {i})" for k, (i, v) in sorted(found.items()))
        if len(kinds) > 1:
            raise InputError(f"{file.path}: column {col!r} mixes types: {listed}; ids must be all integers or all "
                             "strings.")
        raise InputError(f"{file.path}: column {col!r} holds {listed}; ids must be integers or strings: write them "
                         "as one or the other.")
    if "int" in kinds:
        wide = [(offset + i, v) for i, v in enumerate(values) if not _INT64_MIN <= v <= _INT64_MAX]
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
                raise InputError(f"{file.path}: column {col!r} at row {offset + i} is not valid UTF-8 text; fix the id "
                                 "(ids are written to Parquet as strings).") from None
    if not kinds:
        return ("int" if pa.types.is_integer(t) else "str") if t is not None else "empty"
    return kinds.pop()


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


def _passthrough_type(f: InputFile, fr: Frame, col: str) -> pa.DataType | None:
    """A passthrough column's type in one chunk (None: all null)."""
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
    return None if pa.types.is_null(t) else t


def _check_duplicates(files: list[InputFile], ids: list[pa.Array], col: str) -> None:
    """Every id once across all files (Arrow's hash counts: no Python object per row)."""
    import pyarrow.compute as pc

    every = _concat(ids)
    if not len(every):
        return
    counts = pc.value_counts(every)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if not len(repeated):
        return
    dupes = repeated.to_pylist()
    shown = pa.array(dupes[:_MAX_LISTED], every.type)
    where: dict[Any, list[str]] = {}
    for f, a in zip(files, ids, strict=True):
        if len(a):
            for v in a.cast(every.type).filter(pc.is_in(a.cast(every.type), value_set=shown)).to_pylist():
                where.setdefault(v, []).append(f.path)
    sample = "; ".join(f"{v!r} in {', '.join(sorted(set(where[v])))}" for v in dupes[:_MAX_LISTED])
    more = f" (and {len(dupes) - _MAX_LISTED} more)" if len(dupes) > _MAX_LISTED else ""
    raise InputError(f"column {col!r} has {len(dupes)} duplicated id(s): {sample}{more}. Ids must be unique.")


def _listed(values: list[Any]) -> str:
    head = ", ".join(map(str, values[:_MAX_LISTED]))
    return head + (", ..." if len(values) > _MAX_LISTED else "")
