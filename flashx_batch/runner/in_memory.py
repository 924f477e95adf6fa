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
import logging
import os
from collections.abc import Mapping, Sequence
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
            # schema metadata (pandas' records its own version) is no part of the rows: equal rows, equal digest
            table = as_arrow(data).replace_schema_metadata(None)
            uri = stage_table(table, staging_dir or _default_staging(job), job)
            job.data.path, job.data.format = uri, "parquet"
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_BAD_JOB
    return run(job)


_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError,
                 ValueError)


def _column_error(kind: str, columns: Mapping[str, list], exc: Exception) -> ConfigError:
    """The ConfigError for rows Arrow cannot take: the first column that will not convert, with the value
    types it mixes (the same data as a JSONL file names the column too)."""
    for name, values in columns.items():
        try:
            pa.array(values)
        except _ARROW_ERRORS as err:
            types = sorted({type(v).__name__ for v in values})
            return ConfigError(f"run_job(data=<{kind}>): column {name!r} holds values of types {', '.join(types)}, "
                               f"which one Arrow column cannot hold ({type(err).__name__}: "
                               f"{str(err).splitlines()[0][:160]}); give the column one type (e.g. cast it to str).")
    return ConfigError(f"run_job(data=<{kind}>): the rows cannot be read as one Arrow table "
                       f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}).")


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
            raise _column_error(kind, {c: data[c].tolist() for c in data.columns}, exc) from None
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
            raise _column_error(kind, {str(c): list(v) for c, v in data.items()}, exc) from None
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
    if job is not None:
        storage.configure(job.storage.settings())
    name = f"input-{content_digest(table)[:32]}.parquet"
    if storage.is_remote(staging_dir):
        uri = f"{staging_dir.rstrip('/')}/{name}"
        fs, path = storage.filesystem(uri)
        if fs.get_file_info(path).type == pafs.FileType.NotFound:  # object stores write a whole object or none
            with fs.open_output_stream(path) as out:
                pq.write_table(table, out)
        log.info("in-memory input: %d rows staged as %s", table.num_rows, uri)
        return uri
    path = Path(staging_dir).expanduser() / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{name}.{os.getpid()}.partial")
        pq.write_table(table, partial)
        os.replace(partial, path)  # whole or absent: a reader never sees half a file
    log.info("in-memory input: %d rows staged as %s", table.num_rows, path)
    return str(path)


def _default_staging(job: JobConfig) -> str:
    if job.executor.kind == "ray" and job.executor.address is not None:
        raise ConfigError("run_job(data=...) on a Ray cluster (executor.address set): every node reads the input, so "
                          "pass staging_dir= on storage they all reach (s3://..., gs://..., a shared mount).")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache) / "flashx-batch" / "inputs")
