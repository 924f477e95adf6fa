"""Property-based fuzz of preflight + plan: random input files (Parquet / JSONL / CSV, one file, a
directory or a glob; odd types, encodings, BOMs, headers, messages, passthrough columns) and random
sampling / runtime settings, each run as a `dry_run=true` job.

The properties, for every example:
  * the job ends with exit 0 or 2: a setting or an input it cannot use is a bad job (2), never a
    crash (an escaping exception, or exit 1: `runner.run` caught something unexpected);
  * a dry run writes nothing: no output directory, the input untouched;
  * on exit 0 the plan accounts for every input id exactly once: `plan.ids` are the ids written
    (the first `data.limit` rows, files in path order), the shards and error shards together
    cover each row once, and `plan.ref_ids` maps each row back to its id.

The strategies and `check_case` live here so that `jobs/measurements/fuzz_failure_kinds.py` (many examples,
no stop at the first failure, one line per kind of failure) measures exactly what this test runs.
"""

from __future__ import annotations

import atexit
import copy
import io
import json
import logging
import math
import shutil
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_support import WORDS, overrides, tiny_model_dir, tree_snapshot
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import flashx_batch
from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner import run
from flashx_batch.runner.job import plan_job

# Columns the job writes itself: a passthrough column of one of these names collides with them.
OUTPUT_COLUMNS = ("id", "generated_text", "finish_reason", "num_input_tokens", "num_generated_tokens", "shard_id",
                  "error_code", "error_message", "stage")
EXTRA_NAMES = ("source", "meta", "prompt", *[c for c in OUTPUT_COLUMNS if c != "id"])
SUFFIXES = {"parquet": (".parquet", ".pq"), "jsonl": (".jsonl", ".json", ".ndjson"), "csv": (".csv",)}
BOM = b"\xef\xbb\xbf"
INT64_MAX = 2**63 - 1
# Not a valid UTF-8 sequence each: a stray byte, a truncated or overlong sequence, a surrogate (U+D800)
# and a code point past U+10FFFF, all as raw bytes.
BAD_UTF8 = (b"\xff", b"\xfe\xfe", b"\x80", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80")
ODD_TEXT = ("", " ", "  \n\t ", "\u3000", "\x00", "the \x07 licence", "licence\x7f", "the \ud800 licence", "\udfff",
            "licence\r\nnotice", "\ufeffthe licence", "\u00e9 licence", "\u65e5\u672c\u8a9e", "\U0001f642", "\u200b",
            "\u00ad", "{{ raise_exception('x') }}", "<|user|>", "</s>", "<s> the", "\\u0000", "null", "NaN", "a,b",
            'say "the"', "the\nlicence")
BAD_JSONL_LINES = (b"{oops", b"[1, 2]", b"null", b'"a string"', b"{\"id\": 1,}", b"\x00", b"[" * 50_000,
                   b'{"id": 1, "prompt": "the licence"} trailing', b"{" + b'"a":{' * 3000 + b"}" * 3001)


@dataclass(frozen=True)
class Raw:
    """A string cell written as these exact bytes (invalid UTF-8, raw surrogates)."""

    data: bytes

    def as_read(self) -> str:
        # the Python view of undecodable bytes: each one as a lone surrogate (surrogateescape)
        return self.data.decode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class Digits:
    """An integer literal past Python's int/str conversion limit (4300 digits)."""

    text: str


@dataclass
class DataFile:
    """One input file: its name, format, content, and the id of each row as a reader must return it."""

    name: str
    fmt: str
    content: bytes | list[tuple[str, pa.Array]]  # raw bytes (JSONL / CSV) or Parquet columns
    ids: list[Any]

    def __repr__(self) -> str:
        if isinstance(self.content, bytes):
            c = self.content
            return f"{self.name} [{self.fmt}, {len(c)} bytes] {c if len(c) <= 600 else c[:500] + b'...' + c[-100:]!r}"
        cols = ", ".join(f"{n}: {a.type} = {_short(a.to_pylist())}" for n, a in self.content)
        return f"{self.name} [{self.fmt}] {cols}"


@dataclass
class Case:
    files: list[DataFile]
    layout: str  # "file" | "dir" | "glob"
    # other files in the directory: ones a scan must skip, or a broken `datasets` marker (state.json)
    decoys: list[tuple[str, bytes]] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)  # Hydra overrides
    data_name: str | None = None  # layout "file": the file's name when the suffix does not say the format

    def __repr__(self) -> str:
        lines = [f"Case(layout={self.layout}, settings={self.settings}"
                 + (f", file named {self.data_name!r}" if self.data_name else "")
                 + (f", decoys={self.decoys}" if self.decoys else "") + ")"]
        lines += [f"  {f!r}" for f in self.files]
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis prints examples with this
        p.text(repr(self))

    def size(self) -> int:
        """A rough size (smaller is a simpler example) for picking one example per failure kind."""
        n = 0
        for f in self.files:
            n += len(f.content) if isinstance(f.content, bytes) else sum(len(repr(a.to_pylist())) for _, a in f.content)
        return n + 20 * len(self.settings) + 30 * len(self.files) + 10 * len(self.decoys)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------------
# value strategies


def _rarely(draw, n: int) -> bool:
    """True once in `n` draws; the minimal draw (where shrinking heads) is False."""
    return draw(st.integers(0, n - 1)) == n - 1


def _weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    return st.sampled_from([s for w, s in pairs for _ in range(w)]).flatmap(lambda s: s)


GOOD_TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=10).map(" ".join)
RAW_TEXT = st.builds(lambda a, bad, b: Raw(a.encode() + b" " + bad + b" " + b.encode()), GOOD_TEXT,
                     st.sampled_from(BAD_UTF8), GOOD_TEXT)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates and controls included
LONG_TEXT = st.integers(50, 700).map(lambda n: "licence " * n)  # past max_row_bytes / max_input_len
TEXT = _weighted((10, GOOD_TEXT), (2, st.sampled_from(ODD_TEXT)), (2, ANY_TEXT), (1, RAW_TEXT), (1, LONG_TEXT))
BIG_INTS = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -(10**25)])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), BIG_INTS, st.floats(allow_nan=True), ANY_TEXT)
NESTED = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from("abc"), c,
                                                                                    max_size=2), max_leaves=4)
PROMPTS = _weighted((12, TEXT), (1, st.none()), (1, st.integers(-3, 3) | BIG_INTS), (1, st.floats()),
                    (1, st.booleans()), (1, st.lists(GOOD_TEXT, max_size=2)), (1, NESTED))
ROLES = st.sampled_from(["user", "user", "assistant", "system", "tool", "usr", "garbage", "", "USER"])
CONTENT = _weighted((6, GOOD_TEXT), (1, st.just("")), (1, st.none()), (1, st.integers(-2, 2)),
                    (1, st.sampled_from(ODD_TEXT)), (1, RAW_TEXT))


@st.composite
def _message(draw) -> Any:
    shape = draw(st.sampled_from(["ok"] * 6 + ["no content", "no role", "role int", "extra key", "not a dict"]))
    role, content = draw(ROLES), draw(CONTENT)
    return {"ok": {"role": role, "content": content}, "no content": {"role": role},
            "no role": {"content": content}, "role int": {"role": 1, "content": content},
            "extra key": {"role": role, "content": content, "name": "x"},
            "not a dict": draw(st.sampled_from(["user", 3, None, ["user", "hi"]]))}[shape]


MESSAGE_LISTS = st.lists(_message(), min_size=1, max_size=4)
MESSAGES = _weighted((10, MESSAGE_LISTS), (2, MESSAGE_LISTS.map(lambda m: ("json", m))), (1, st.none()),
                     (1, st.just([])), (1, st.sampled_from([3, "not json", '{"role": "user"}', "[]", "[1]",
                                                            '[{"role": "user", "content": "the"}'])),
                     (1, _message()))

# A passthrough / extra column holds one kind of value per dataset (so types often agree across files).
EXTRA_KINDS = {
    "int": st.integers(-1000, 1000), "str": GOOD_TEXT, "float": st.floats(allow_nan=True), "none": st.none(),
    "list": st.lists(st.integers(0, 9), max_size=3), "dict": st.fixed_dictionaries({"a": st.integers(0, 9)}),
    "big int": BIG_INTS, "odd str": st.sampled_from(ODD_TEXT) | RAW_TEXT, "mixed": NESTED,
    "bad str": st.sampled_from(["the \ud800 licence", "\udfff", "the licence"]) | RAW_TEXT,
}


def _plain(value: Any) -> Any:
    """The value a JSON parser returns for what `_json_bytes` writes (Raw as its surrogateescape view)."""
    if isinstance(value, Raw):
        return value.as_read()
    if isinstance(value, Digits):
        return value.text
    if isinstance(value, tuple):  # ("json", messages): a messages list stored as its JSON text
        return json.dumps(_plain(value[1]))
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------------------
# file writers: each takes logical rows (column -> value) and returns the file and its ids as read


def _json_bytes(value: Any, ascii_only: bool) -> bytes:
    if isinstance(value, Raw):
        return b'"' + value.data + b'"'
    if isinstance(value, Digits):
        return value.text.encode()
    if isinstance(value, tuple):
        return _json_bytes(json.dumps(_plain(value[1])), ascii_only)
    if isinstance(value, str):
        # ensure_ascii=False keeps a lone surrogate as a character: written as its raw 3 bytes
        return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    if isinstance(value, list):
        return b"[" + b", ".join(_json_bytes(v, ascii_only) for v in value) + b"]"
    if isinstance(value, dict):
        return b"{" + b", ".join(json.dumps(k).encode() + b": " + _json_bytes(v, ascii_only)
                                 for k, v in value.items()) + b"}"
    return json.dumps(value).encode()  # NaN / Infinity as Python's json writes (and reads) them


def _json_read(value: Any, ascii_only: bool) -> Any:
    if isinstance(value, str) and not ascii_only:
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "surrogateescape")
    if isinstance(value, list):
        return [_json_read(v, ascii_only) for v in value]
    return _plain(value)


@st.composite
def _jsonl_file(draw, rows: list[dict[str, Any]], id_col: str, k: int) -> tuple[bytes, list[Any]]:
    ascii_only = draw(st.booleans())
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    lines, ids = [], []
    dropping = _rarely(draw, 10 * k)  # now and then rows lack a key
    for row in rows:
        if _rarely(draw, 10):
            lines.append(draw(st.sampled_from([b"", b"   ", b"\t", b"\r"])))  # blank lines are not rows
        keys = [key for key in row if not (dropping and _rarely(draw, 4))]
        lines.append(b"{" + b", ".join(json.dumps(key).encode() + b": " + _json_bytes(row[key], ascii_only)
                                       for key in keys) + b"}")
        ids.append(_json_read(row[id_col], ascii_only) if id_col in keys else None)
    if _rarely(draw, 25 * k):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(BAD_JSONL_LINES)))
    body = eol.join(lines) + (eol if draw(st.booleans()) else b"")
    return (BOM if _rarely(draw, 12 * k) else b"") + body, ids


def _cell(value: Any) -> bytes:
    """A value as CSV text: CSV has no types, so numbers and lists are written as their text."""
    if value is None:
        return b""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, bool | int | float | Digits):
        return (value.text if isinstance(value, Digits) else str(value)).encode()
    return json.dumps(_plain(value)).encode("utf-8", "surrogatepass")


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _quoted(cell: bytes, force: bool) -> bytes:
    if force or any(ch in cell for ch in (b",", b'"', b"\n", b"\r")):
        return b'"' + cell.replace(b'"', b'""') + b'"'
    return cell


@st.composite
def _csv_file(draw, rows: list[dict[str, Any]], columns: list[str], id_col: str,
              k: int) -> tuple[bytes, list[Any]]:
    header = list(columns)
    odd_shapes = ["dup id", "dup other", "no id", "no text", "unnamed extra"]
    shape = draw(st.sampled_from(odd_shapes)) if _rarely(draw, 5 * k) else ""
    if shape == "dup id":
        header.insert(draw(st.integers(0, len(header))), id_col)  # the same values twice
    elif shape == "dup other" and len(header) > 1:
        header.append(draw(st.sampled_from([c for c in header if c != id_col])))
    elif shape == "no id":
        header.remove(id_col)
    elif shape == "no text" and len(columns) > 1:
        header.remove(columns[1])
    elif shape == "unnamed extra":
        header.append("")
    header = draw(st.permutations(header))
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    lines = [b",".join(_quoted(h.encode(), draw(st.booleans())) for h in header)]
    ids = []
    for row in rows:
        if _rarely(draw, 15):
            lines.append(b"")  # an empty line is skipped by CSV readers
        # a column listed twice gets its own values, except the id (both copies agree)
        cells = [_cell(row.get(h) if h == id_col or i == header.index(h) else draw(PROMPTS))
                 for i, h in enumerate(header)]
        if k > 1:  # a tidy file: every cell valid UTF-8 (one bad byte fails the whole CSV file)
            cells = [c if _utf8(c) else b"the licence" for c in cells]
        lines.append(b",".join(_quoted(c, _rarely(draw, 5)) for c in cells))
        ids.append(cells[header.index(id_col)].decode("utf-8", "surrogateescape") if id_col in header else None)
    if rows and _rarely(draw, 25 * k):
        lines.append(lines[-1] + b",extra")  # one row with a field too many
    body = eol.join(lines) + (eol if draw(st.booleans()) else b"")
    return (BOM if _rarely(draw, 12 * k) else b"") + body, ids


def _empty_struct(t: pa.DataType) -> bool:
    """Parquet cannot store a struct without fields (`{}` values), at any depth."""
    if pa.types.is_struct(t):
        return t.num_fields == 0 or any(_empty_struct(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _empty_struct(t.value_type)
    return False


def _arrow(values: list[Any]) -> pa.Array:
    plain = [None if v is None else v.data if isinstance(v, Raw) else _plain(v) for v in values]
    try:
        arr = pa.array(plain)
        if not _empty_struct(arr.type):
            return arr
    except (pa.ArrowException, OverflowError, UnicodeEncodeError, TypeError, ValueError):
        pass
    # mixed or unencodable values: stored as bytes, the way a binary column carries them
    return pa.array([None if v is None else _cell(v) for v in values], pa.binary())


@st.composite
def _parquet_file(draw, rows: list[dict[str, Any]], columns: list[str], id_col: str, id_style: str,
                  k: int) -> tuple[list[tuple[str, pa.Array]], list[Any]]:
    out = []
    for c in columns:
        values = [row.get(c) for row in rows]
        if not rows:
            arr = pa.array([], pa.int64() if c == id_col and id_style == "int" else pa.string())
        elif c == "messages" and _rarely(draw, 4):
            arr = pa.array([None if v is None else json.dumps(_plain(v)) for v in values], pa.string())
        else:
            arr = _arrow(values)
        cast = draw(st.sampled_from([None] * 6 * k + ["int32", "uint64", "large_string", "dictionary", "binary"]))
        target = {"int32": pa.int32(), "uint64": pa.uint64(), "large_string": pa.large_string(),
                  "binary": pa.binary()}.get(cast or "")
        try:
            if cast == "dictionary" and pa.types.is_string(arr.type):
                arr = arr.dictionary_encode()
            elif target is not None and (pa.types.is_integer(arr.type) or pa.types.is_string(arr.type)):
                arr = arr.cast(target)
        except (pa.ArrowException, OverflowError):
            pass
        out.append((c, arr))
    if columns and _rarely(draw, 30 * k):
        out.append(out[-1])  # a column name twice
    if _rarely(draw, 25 * k):
        out = [(n, a) for n, a in out if n != id_col]
    ids_col = [a for n, a in out if n == id_col]
    ids = ids_col[0].to_pylist() if ids_col else [None] * len(rows)
    return out, ids


# ---------------------------------------------------------------------------------------------------
# datasets and settings


@st.composite
def _ids(draw, style: str, start: int, n: int, k: int) -> list[Any]:
    if style == "int":
        base = draw(st.sampled_from([0, 0, 0, 1, -50, 2**31 - 4, INT64_MAX - 40, -(2**63), 2**64, 10**30]))
        ids: list[Any] = [base + start + i for i in range(n)]
    elif style == "str":
        pattern = draw(st.sampled_from(["doc-{}", "{}", "{:05d}", "\u00e9-{}", "\u884c{}", " {} ", "a,{}", 'q"{}',
                                        "id\n{}", "\ud800{}", "\U0001f642{}", "{}\x00"]))
        ids = [pattern.format(start + i) for i in range(n)]
    else:  # anything: mostly exit 2 (nulls, floats, bools, mixed types), sometimes a clean column
        ids = draw(st.lists(_weighted((3, st.integers(-3, 3)), (1, st.none()), (1, st.booleans()),
                                      (1, st.floats()), (2, ANY_TEXT), (1, BIG_INTS), (1, NESTED)),
                            min_size=n, max_size=n))
    if n > 1 and _rarely(draw, 15 * k):
        ids[draw(st.integers(1, n - 1))] = ids[0]  # a duplicated id
    return ids


@st.composite
def _dataset(draw, text_col: str) -> tuple[list[DataFile], list[str], bool]:
    """1..3 files (of one format or mixed); returns them, the extra columns they all hold, and whether the
    dataset is tidy: half are, with job-level problems (which exit 2 before any plan) four times rarer,
    so that enough examples reach the plan."""
    tidy = not draw(st.booleans())
    k = 4 if tidy else 1
    n_files = draw(st.integers(1, 3))
    id_style = draw(st.sampled_from(["int", "int", "str", "str"] + ([] if tidy else ["any"])))
    # CSV ids are text: in a tidy dataset integer ids come from typed formats only
    formats = ["jsonl", "parquet"] if tidy and id_style == "int" else sorted(SUFFIXES)
    extras = draw(st.lists(st.sampled_from(EXTRA_NAMES), max_size=3, unique=True))
    extras = [c for c in extras if c != text_col]
    kinds = {c: draw(st.sampled_from(list(EXTRA_KINDS))) for c in extras}
    mixed_formats = draw(st.booleans())
    fmt0 = draw(st.sampled_from(formats))
    names = draw(st.lists(st.sampled_from("abcdeXY"), min_size=n_files, max_size=n_files, unique=True))
    files, start = [], 0
    for name in names:
        fmt = draw(st.sampled_from(formats)) if mixed_formats else fmt0
        n = draw(_weighted((6 * k, st.integers(1, 10)), (1, st.just(0))))
        ids = draw(_ids(id_style, start, n, k))
        start += n
        texts = [draw(MESSAGES if text_col == "messages" else PROMPTS) for _ in range(n)]
        if fmt != "parquet" and n and _rarely(draw, 30 * k):
            texts[draw(st.integers(0, n - 1))] = Digits("9" * 4400)  # past int("...")'s digit limit
        rows = [{"id": i, text_col: t, **{c: draw(EXTRA_KINDS[kinds[c]]) for c in extras}} for i, t in zip(ids, texts)]
        columns = ["id", text_col, *extras]
        if fmt == "jsonl":
            content, read_ids = draw(_jsonl_file(rows, "id", k))
        elif fmt == "csv":
            content, read_ids = draw(_csv_file(rows, columns, "id", k))
        else:
            content, read_ids = draw(_parquet_file(rows, columns, "id", id_style, k))
        if _rarely(draw, 40 * k):  # an empty (0-byte) or truncated file
            content, read_ids = draw(st.sampled_from([b"", b"PAR1\x00\x01", b"{", b"id,pro"])), []
        files.append(DataFile(f"part-{name}{draw(st.sampled_from(SUFFIXES[fmt]))}", fmt, content, read_ids))
    return files, extras, tidy


# key -> (values a job may use, values it must refuse or cope with); most examples draw from the first
# list only, so that enough of them get past the settings to the input and the plan.
SETTINGS = {
    "sampling.temperature": (["0", "0.7", "1", "2.5", "1e308"], ["-1", "nan", "inf", "-inf", "abc"]),
    "sampling.top_p": (["1", "0.9", "0.01"], ["0", "-0.5", "1.5", "nan", "inf"]),
    "sampling.top_k": (["0", "5", "1", "100000"], ["-1", "1.5", "nan", "100000000000000000000"]),
    "sampling.max_new_tokens": (["1", "8", "16"], ["17", "0", "-3", "nan", "1.5"]),
    "sampling.seed": (["0", "7", "-1", "9223372036854775807"], ["1180591620717411303424", "nan", "1.5"]),
    "runtime.max_input_len": (["1", "2", "4", "16", "64", "512", "100000000000"], ["0", "-1", "1e400"]),
    "runtime.shard_size": (["1", "2", "3", "64"], ["0", "-1", "nan"]),
    "runtime.max_batch_size": (["1", "4", "1000"], ["0", "-2"]),
    "runtime.long_input": (["error", "truncate"], ["rolling_merge", "bogus"]),
    "runtime.prefix_cache_tokens": (["0", "64"], ["-1"]),
    "runtime.bucket_edges": (["[]", "[4,8]", "[100000]"], ["[0]", "[-3]"]),
    "executor.grace_period_s": (["60", "0", "0.5"], ["-1", "nan", "inf", "-inf"]),
    "executor.progress_interval_s": (["10", "1"], ["0", "-5", "nan", "inf"]),
    "data.limit": (["null", "1", "2", "5", "13", "1000"], ["0", "-1"]),
    "data.max_row_bytes": (["8", "64", "4000", "1000000"], ["1", "0", "-1"]),
    "model.dtype": (["auto", "float32", "bfloat16", "float16"], ["float64", "fp16", "''", "null"]),
}


@st.composite
def _settings(draw) -> list[str]:
    hostile = _rarely(draw, 4)
    out = []
    for key, (good, bad) in SETTINGS.items():
        if draw(st.integers(0, 9)) >= 7:
            out.append(f"{key}={draw(st.sampled_from(good + bad if hostile else good))}")
    return out


@st.composite
def cases(draw) -> Case:
    use_messages = _rarely(draw, 4)
    text_col = "messages" if use_messages else "prompt"
    files, extras, tidy = draw(_dataset(text_col))
    settings_ = draw(_settings())
    if use_messages or _rarely(draw, 20):  # now and then on a dataset without the column
        settings_.append("data.messages_column=messages")
    if extras and draw(st.booleans()):
        chosen = draw(st.lists(st.sampled_from(extras), min_size=1, max_size=3))  # a name twice, now and then
        settings_.append(f"data.passthrough_columns=[{','.join(chosen)}]")
    elif not tidy and _rarely(draw, 10):  # columns the input may not have, "id" and "prompt" included
        chosen = draw(st.lists(st.sampled_from(sorted({*EXTRA_NAMES, "id"})), max_size=2))
        settings_.append(f"data.passthrough_columns=[{','.join(chosen)}]")
    layout = draw(st.sampled_from(["file", "dir", "glob"] if len(files) == 1 else ["dir", "glob"]))
    data_name = None
    if layout == "file" and _rarely(draw, 10):
        data_name = "input.txt"  # no suffix to go by: data.format says it
        fmt = draw(st.sampled_from([files[0].fmt] * 3 + sorted(SUFFIXES) + ["arrow"]))
        settings_.append(f"data.format={fmt}")
    elif layout == "file" and _rarely(draw, 30):
        settings_.append(f"data.format={draw(st.sampled_from([*sorted(SUFFIXES), 'arrow', 'auto', 'bogus']))}")
    decoys = []
    if layout != "file" and draw(st.booleans()):
        # a directory scan skips hidden / underscore entries and unknown suffixes; the glob part-* never sees them
        decoys = draw(st.lists(st.sampled_from([(".hidden.jsonl", b"{oops\n"), ("_scratch.csv", b"\xff\xfe,\n"),
                                                ("_tmp/part-z.jsonl", b"not json\n"), ("notes.txt", b"hello\n"),
                                                (".cache/part-y.parquet", b"PAR1")]),
                               max_size=3, unique=True))
    if layout == "dir" and _rarely(draw, 15):
        # a file that makes the directory look like a `datasets` save_to_disk folder, but a broken one
        decoys.append(draw(st.sampled_from([("state.json", b"{oops"), ("state.json", b"[]"),
                                            ("state.json", b'{"_data_files": [{"name": "x.arrow"}]}'),
                                            ("state.json", b'{"_data_files": []}'),
                                            ("dataset_dict.json", b"not json"), ("dataset_dict.json", b"[1]"),
                                            ("dataset_dict.json", b'{"splits": "train"}')])))
    return Case(files, layout, decoys, draw(st.permutations(settings_)), data_name)


def write_case(case: Case, root: Path) -> str:
    """Write the input files under `root`; returns data.path (the file, the directory or the glob)."""
    root.mkdir(parents=True)
    for f in case.files:
        path = root / (case.data_name or f.name)
        if isinstance(f.content, bytes):
            path.write_bytes(f.content)
        else:
            pq.write_table(pa.Table.from_arrays([a for _, a in f.content], names=[n for n, _ in f.content]), path)
    for name, data in case.decoys:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    if case.layout == "file":
        return str(root / (case.data_name or case.files[0].name))
    return str(root) if case.layout == "dir" else str(root / "part-*")


# ---------------------------------------------------------------------------------------------------
# running one case


@dataclass
class Finding:
    """A property failure: `kind` groups failures with one cause; `detail` is this example's evidence."""

    kind: str
    detail: str
    extra: bool = False  # found by the extra checks only (not a property of the test)


_PACKAGE = Path(flashx_batch.__file__).resolve().parent


def _where(exc: BaseException) -> str:
    """The innermost flashx_batch frame of the traceback, as `flashx_batch/path.py:function`."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve().is_relative_to(_PACKAGE)]
    if not frames:
        return "outside flashx_batch"
    f = frames[-1]
    return f"flashx_batch/{Path(f.filename).resolve().relative_to(_PACKAGE).as_posix()}:{f.name}"


def _exc_finding(what: str, exc: BaseException) -> Finding:
    first = (str(exc).splitlines() or [""])[0][:300]
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
    return Finding(f"{what}: {type(exc).__name__} at {_where(exc)}", f"{type(exc).__name__}: {first}\n{tb}")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _check_plan(case: Case, job: Any) -> Finding | None:
    try:
        plan = plan_job(job).plan
    except Exception as exc:  # the dry run just built the same plan
        return _exc_finding("plan_job raised after a dry run exited 0", exc)
    files = sorted(case.files, key=lambda f: f.name)
    rows = [((fi, ri), i) for fi, f in enumerate(files) for ri, i in enumerate(f.ids)]
    if job.data.limit is not None:
        rows = rows[: job.data.limit]
    # ids compared by repr: 1, "1" and True are different ids (and any value is hashable that way)
    want, got = Counter(repr(i) for _, i in rows), Counter(repr(i) for i in plan.ids)
    if want != got:
        return Finding("exit 0 but the plan's ids differ from the ids written",
                       f"missing {_short(sorted((want - got).elements()))}, "
                       f"unexpected {_short(sorted((got - want).elements()))}; plan.ids={_short(plan.ids)}")
    refs = Counter(r for s in plan.shards + plan.error_shards for r in s.refs)
    want_refs = Counter(ref for ref, _ in rows)
    if refs != want_refs:
        return Finding("exit 0 but shards + error shards do not cover each row exactly once",
                       f"missing {_short(sorted(want_refs - refs))}, "
                       f"extra or duplicated {_short(sorted(refs - want_refs))}")
    wrong = [(ref, i, plan.ref_ids.get(ref, "<absent>")) for ref, i in rows
             if ref not in plan.ref_ids or repr(plan.ref_ids[ref]) != repr(i)]
    if wrong:
        return Finding("exit 0 but plan.ref_ids does not map rows back to their ids",
                       f"(ref, written, ref_ids) {_short(wrong)}")
    return None


def _extra_checks(job: Any) -> Finding | None:
    """What a dry run accepted but the real run could not write or use (reported by the measuring script)."""
    try:
        planned = plan_job(job)
        loaded, plan = planned.loaded, planned.plan
    except Exception:  # reported by the properties already
        return None
    id_type = pa.int64() if plan.id_kind == "int" else pa.string()
    try:
        pa.array(plan.ids, id_type)
    except (pa.ArrowException, OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
        return Finding(f"exit 0 but an id cannot be written as {id_type}", f"{type(exc).__name__}: {exc}", True)
    clash = sorted(set(job.data.passthrough_columns) & set(OUTPUT_COLUMNS))
    if clash:
        return Finding("exit 0 with a passthrough column named like an output column", f"{clash}", True)
    for c in job.data.passthrough_columns:
        values = [v for fr in loaded.frames for v in fr.columns[c]]
        try:
            pa.array(values)
        except (pa.ArrowException, OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
            return Finding("exit 0 but a passthrough column cannot be written", f"{c}: {type(exc).__name__}", True)
    s, e = job.sampling, job.executor
    odd = [k for k, v in (("sampling.temperature", s.temperature), ("sampling.top_p", s.top_p),
                          ("executor.grace_period_s", e.grace_period_s),
                          ("executor.progress_interval_s", e.progress_interval_s)) if not math.isfinite(v) or v < 0]
    if odd:
        return Finding(f"exit 0 with an unusable setting: {', '.join(odd)}", f"{odd}", True)
    return None


_WORKDIR: list[Path] = []
_COMPOSED: dict[tuple[str, ...], Any] = {}


def _workdir() -> Path:
    """One scratch directory per process, emptied after each example: every example gets the same paths,
    so a repeated set of overrides (shrinking repeats them) composes to the same config."""
    if not _WORKDIR:
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None  # many small files: keep them off the disk
        _WORKDIR.append(Path(tempfile.mkdtemp(prefix="fx-fuzz-", dir=base)))
        atexit.register(shutil.rmtree, _WORKDIR[0], True)
    return _WORKDIR[0]


def _compose(args: list[str]) -> Any:
    """`compose_job`, remembered per override list: composing is a pure function of the overrides and
    costs most of an example's time (Hydra), which would make a failing test shrink for minutes."""
    key = tuple(args)
    if key not in _COMPOSED:
        if len(_COMPOSED) > 20_000:
            _COMPOSED.clear()
        try:
            _COMPOSED[key] = compose_job(args)
        except ConfigError as exc:
            _COMPOSED[key] = exc
    hit = _COMPOSED[key]
    if isinstance(hit, ConfigError):
        raise ConfigError(str(hit))
    return copy.deepcopy(hit)


def check_case(model_dir: Path, case: Case, extra_checks: bool = False,
               outcomes: Counter | None = None) -> Finding | None:
    """Run `case` as a dry run; None when every property holds, else the first failure found.

    `outcomes`, when given, counts how each example ended (to see what share reaches a plan)."""
    outcomes = Counter() if outcomes is None else outcomes
    root = _workdir()
    try:
        data_path = write_case(case, root / "in")
        out_dir = root / "out"
        before = tree_snapshot(root / "in")
        try:
            job = _compose(overrides(model_dir, data_path, out_dir, "dry_run=true", *case.settings))
        except ConfigError:
            outcomes["compose: ConfigError (exit 2)"] += 1
            return None  # a bad setting: exit 2, as the CLI maps it
        except Exception as exc:
            return _exc_finding("exception from compose_job", exc)
        handler = _Records()
        logger = logging.getLogger("flashx_batch")
        logger.addHandler(handler)
        try:
            code = run(job, out=io.StringIO())
        except Exception as exc:
            return _exc_finding("exception escaped runner.run", exc)
        finally:
            logger.removeHandler(handler)
        outcomes[f"run: exit {code}"] += 1
        if code == 1:
            caught = [r for r in handler.records if r.exc_info and r.exc_info[1] is not None]
            if caught:
                return _exc_finding("exit 1", caught[-1].exc_info[1])
            errors = [r.getMessage() for r in handler.records if r.levelno >= logging.ERROR]
            return Finding("exit 1 (logged, no traceback)", _short(errors, 500))
        if code not in (0, 2):
            return Finding(f"exit {code}", "")
        logged = [r for r in handler.records if r.exc_info and r.exc_info[1] is not None]
        if logged:  # a bad job is explained in one line; a traceback means something unexpected ran
            return _exc_finding(f"exit {code} with a traceback logged", logged[-1].exc_info[1])
        if out_dir.exists():
            return Finding(f"dry run (exit {code}) created output.dir", str(sorted(out_dir.rglob("*"))[:5]))
        if tree_snapshot(root / "in") != before:
            return Finding(f"dry run (exit {code}) changed the input files", "")
        if code == 0:
            return _check_plan(case, job) or (_extra_checks(job) if extra_checks else None)
        return None
    finally:
        for d in ("in", "out"):
            shutil.rmtree(root / d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# the test


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # no explain: it re-runs examples
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(case=cases())
def test_dry_run_never_crashes_and_plans_every_id_once(model_dir, case):
    # extra checks too: what the dry run accepted, the real run must be able to write and use
    finding = check_case(model_dir, case, extra_checks=True)
    assert finding is None, f"{finding.kind}\n{finding.detail}"
