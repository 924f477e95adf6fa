"""`run_job`: a batch job from Python, on a config and optionally an in-memory table instead of `data.path`.

An in-memory table (pyarrow Table, pandas DataFrame, `datasets.Dataset`, Ray Dataset, or a dict of
columns) is staged once as a Parquet file named by the digest of its contents, and the job reads that
file: every guarantee of a job on files holds (the plan, the input fingerprint — computed from the
staged bytes, so from the data itself —, resume, exactly once). The same data staged again finds its
file and is not rewritten, so a rerun resumes; other data is another file, and a resume with it is
refused as a changed input.

Where it is staged: `staging_dir` (default: `$XDG_CACHE_HOME/flashx-batch/inputs`, ~/.cache otherwise).
A job on a Ray cluster reads its input on every node, so it needs a `staging_dir` every node reaches
(`s3://...`, `gs://...`, a shared mount): a local default is refused for `executor.address` set.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flashx_batch import storage
from flashx_batch.config import JobConfig, compose_job
from flashx_batch.errors import ConfigError

log = logging.getLogger(__name__)


def run_job(config: JobConfig | Sequence[str], data: Any = None, staging_dir: str | None = None) -> int:
    """Run (or resume) a job; returns its exit code (0: every row committed; docs/reliability.md).

    `config`: a `JobConfig` or Hydra overrides as on the command line (`["conf=legal_docs",
    "output.dir=out/x"]`). `data`: rows to run instead of `data.path` — a pyarrow Table, a pandas
    DataFrame, a `datasets.Dataset`, a Ray Dataset or a dict of equal-length columns, with the columns
    the job reads (`data.id_column`, `data.prompt_column`, ...). A config or data that can never run
    (a column Arrow cannot hold, a bad override) is exit 2 with the reason logged, as from the command
    line; rows that cannot run are error rows, as from a file."""
    from flashx_batch.runner.job import EXIT_BAD_JOB, run

    try:
        if isinstance(config, JobConfig):
            job = config
        else:  # with data, a preset without data.path composes too (the user's overrides come after and win)
            job = compose_job((["data.path=in-memory"] if data is not None else []) + list(config))
        if data is not None:
            where = staging_dir or _default_staging(job)
            try:
                # schema metadata (pandas' records its own version) is no part of the rows: equal rows, equal digest
                table = as_arrow(data).replace_schema_metadata(None)
                _check_columns(job, data, table.column_names)
                job.data.path, job.data.format = stage_table(table, where, job), "parquet"
            except MixedColumns as mixed:  # what a file of these rows would be: JSON Lines, validated row by row
                _check_columns(job, data, list(dict.fromkeys(k for r in mixed.records[:1] for k in r)))
                log.warning("%s: staged as JSON Lines, read as a .jsonl file is (a value of the wrong type is its "
                            "row's error row, mixed ids refuse the job)", mixed)
                job.data.path, job.data.format = stage_lines(mixed.records, where, job), "jsonl"
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_BAD_JOB
    return run(job)


def _check_columns(job: JobConfig, data: Any, names: list[str]) -> None:
    """The columns the job reads are in the table: a message that names the object passed (not the file it
    is staged as) and the setting that asked for each missing column."""
    from flashx_batch.data.preflight import missing_columns_message
    from flashx_batch.data.readers import MissingColumns
    from flashx_batch.tasks import read_columns

    roles = read_columns(job)
    missing = [c for c in roles if c not in names]
    if missing:
        where = f"run_job(data=<{type(data).__module__}.{type(data).__name__}>)"
        raise ConfigError(missing_columns_message(MissingColumns(where, missing, names), roles))


_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError,
                 ValueError)


class MixedColumns(ConfigError):
    """Rows whose columns one Arrow table cannot hold (a column of mixed Python types, an integer past
    int64): `run_job` stages them as JSON Lines instead, so they meet a file's validation (`records`:
    the rows as dicts). Raised by `as_arrow`; a ConfigError for any other caller."""

    def __init__(self, message: str, records: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.records = records


def _mixed(kind: str, columns: Mapping[str, list], exc: Exception) -> MixedColumns:
    """The first column that will not convert, with the value types it mixes."""
    message = (f"run_job(data=<{kind}>): the rows cannot be one Arrow table ({type(exc).__name__}: "
               f"{str(exc).splitlines()[0][:160]})")
    for name, values in columns.items():
        try:
            pa.array(values)
        except _ARROW_ERRORS:
            types = sorted({type(v).__name__ for v in values})
            message = f"run_job(data=<{kind}>): column {name!r} holds values of types {', '.join(types)}"
            break
    names = list(columns)
    return MixedColumns(message, [dict(zip(names, row)) for row in zip(*columns.values())])


class _NotJson(Exception):
    """A cell JSON Lines cannot hold as the value it is (a datetime, an object)."""


def _jsonable(value: Any) -> Any:
    """A cell as JSON holds it: numpy scalars as Python numbers and numpy arrays as lists (pandas' list
    columns), a float NaN (pandas' missing value) as null, bytes as their UTF-8 text (invalid bytes kept
    as lone surrogates, which the row checks flag as `invalid_text`, as a binary Parquet column's are).
    Anything else JSON has no type for raises `_NotJson` rather than become text it never was."""
    if type(value).__module__ == "numpy":
        value = value.tolist()  # a scalar's Python value, or an array's nested lists
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return None if value != value else value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="surrogateescape")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    raise _NotJson(type(value).__name__)


def stage_lines(records: list[dict[str, Any]], staging_dir: str, job: JobConfig | None = None) -> str:
    """Write rows as `<staging_dir>/input-<digest>.jsonl` unless that file exists (as `stage_table`)."""
    if not records:
        raise ConfigError("run_job(data=...): the table has no rows.")
    lines = []
    for i, record in enumerate(records):
        row = {}
        for column, value in record.items():
            try:
                row[column] = _jsonable(value)
            except _NotJson as exc:
                raise ConfigError(f"run_job(data=...): column {column!r} row {i} holds a {exc} value, which neither "
                                  "one Arrow column (the column mixes types) nor JSON can hold as it is; give the "
                                  "column one type (e.g. cast it to str).") from None
        try:
            lines.append(json.dumps(row) + "\n")
        except ValueError as exc:  # an integer past Python's 4,300 printable digits
            raise ConfigError(f"run_job(data=...): row {i} cannot be written as JSON ({exc}).") from None
    data = "".join(lines).encode("utf-8", errors="surrogatepass")
    return _stage(lambda out: out.write(data), f"input-{hashlib.sha256(data).hexdigest()[:32]}.jsonl", staging_dir,
                  job)


def as_arrow(data: Any) -> pa.Table:
    """The rows of an in-memory table as one pyarrow Table (a ConfigError naming the types taken)."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    kind = f"{type(data).__module__}.{type(data).__name__}"
    if kind.startswith("pandas.") and hasattr(data, "columns"):
        try:
            return pa.Table.from_pandas(data, preserve_index=False)
        except _ARROW_ERRORS as exc:
            raise _mixed(kind, {str(c): data[c].tolist() for c in data.columns}, exc) from None
    if kind.startswith("datasets.") and hasattr(data, "with_format"):
        return data.with_format("arrow")[:]  # respects a select / shuffle / filter's index mapping
    if kind.startswith("ray.data.") and hasattr(data, "to_arrow_refs"):
        import ray

        tables = ray.get(data.to_arrow_refs())  # in the dataset's block order (its rows' order)
        return pa.concat_tables(tables) if tables else pa.table({})
    if isinstance(data, Mapping):
        try:
            return pa.table(dict(data))
        except _ARROW_ERRORS as exc:
            raise _mixed(kind, {str(c): list(v) for c, v in data.items()}, exc) from None
    raise ConfigError(f"run_job(data=...) takes a pyarrow Table, pandas DataFrame, datasets.Dataset, Ray Dataset or "
                      f"a dict of columns, not {kind}.")


def content_digest(table: pa.Table) -> str:
    """sha256 of the table's schema and rows (its Arrow IPC stream): equal data, equal digest."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue()).hexdigest()


def stage_table(table: pa.Table, staging_dir: str, job: JobConfig | None = None) -> str:
    """Write `table` as `<staging_dir>/input-<digest>.parquet` unless that file exists; returns its path or URI
    (an object-store staging_dir opens with `job`'s storage.* keys)."""
    if table.num_rows == 0:
        raise ConfigError("run_job(data=...): the table has no rows.")
    return _stage(lambda out: pq.write_table(table, out), f"input-{content_digest(table)[:32]}.parquet", staging_dir,
                  job)


def _stage(write: Callable[[Any], None], name: str, staging_dir: str, job: JobConfig | None) -> str:
    """`<staging_dir>/<name>`, written by `write(stream)` unless that file exists (its name is its content's
    digest, so the table is written straight to its file, never copied in memory first); returns its path
    or URI (an object-store staging_dir opens with `job`'s storage.* keys)."""
    if job is not None:
        storage.configure(job.storage.settings())
    if storage.is_remote(staging_dir):
        uri = f"{staging_dir.rstrip('/')}/{name}"
        fs, path = storage.filesystem(uri)
        if fs.get_file_info(path).type == pafs.FileType.NotFound:  # object stores write a whole object or none
            with fs.open_output_stream(path) as out:
                write(out)
        log.info("in-memory input staged as %s", uri)
        return uri
    path = Path(staging_dir).expanduser() / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{name}.{os.getpid()}.partial")
        with open(partial, "wb") as out:
            write(out)
        os.replace(partial, path)  # whole or absent: a reader never sees half a file
    log.info("in-memory input staged as %s", path)
    return str(path)


def _default_staging(job: JobConfig) -> str:
    if job.executor.kind == "ray" and job.executor.address is not None:
        raise ConfigError("run_job(data=...) on a Ray cluster (executor.address set): every node reads the input, so "
                          "pass staging_dir= on storage they all reach (s3://..., gs://..., a shared mount).")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache) / "flashx-batch" / "inputs")
