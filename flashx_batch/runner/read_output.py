"""`read_output(uri)`: a job's committed output as a `pyarrow.dataset`, local or on an object store.

Who calls it: users (`flashx_batch.read_output`), the tests. It reads what the commit protocol
says is committed — `_SUCCESS`'s file list once the job finished, the winning manifests while it
runs — never a directory listing, which may hold the parts of a zombie attempt (runner/layout.py,
runner/object_layout.py).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from flashx_batch import storage
from flashx_batch.errors import ConfigError
from flashx_batch.runner.consolidate import pieces_table
from flashx_batch.runner.layout import KINDS
from flashx_batch.runner.outputs import open_output
from flashx_batch.tasks.tables import errors_table


def read_output(uri: str | Path, kind: str = "generations",
                settings: storage.StorageSettings | None = None) -> ds.Dataset:
    """The committed rows of one kind (generations | errors | stats) of the job at `uri` (a local
    output.dir or an s3:// / gs:// / hdfs:// URI). `settings`: object-store access for this process
    (default: whatever `storage.configure` installed, else the environment's). A job still running or
    interrupted gives the rows committed so far; `ConfigError` if `uri` holds no job."""
    if kind not in KINDS:
        raise ConfigError(f"read_output: kind={kind!r} is not one of {', '.join(KINDS)}.")
    if settings is not None:
        storage.configure(settings)
    out = open_output(uri)
    if out.read_job() is None:
        raise ConfigError(f"read_output: {uri} holds no job (no job.json).")
    done = out.success_record()
    if done is not None and "files" in done:  # finished: the consolidated files, a plain glob as well
        return _dataset([f"{out.base}/{name}" for name in done["files"].get(kind, [])], out.fs)
    # running or stopped: each committed piece's rows, wherever they are now
    committed = out.committed()
    table = pieces_table(out, kind, committed)
    if table is None and kind == "errors":  # none yet: the columns error rows have, as a finished job gives
        # the id type from one generated piece's id column (not every piece's rows)
        piece = next((p for p, m in committed.items() if "generations" in m.get("files", {})), None)
        ids = out.read_part("generations", piece, ["id"], committed).schema.field("id").type if piece else None
        table = errors_table([], "int" if ids is not None and pa.types.is_integer(ids) else "str", [], [], [])
    return ds.dataset(table) if table is not None else ds.dataset([], schema=pa.schema([]))


def _dataset(paths: list[str], fs) -> ds.Dataset:
    if not paths:
        return ds.dataset([], schema=pa.schema([]))
    return ds.dataset(paths, format="parquet", filesystem=fs)
