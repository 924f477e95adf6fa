"""Few, large output files: the committed pieces of one kind rewritten into `part-NNNNN.parquet`
files of about `TARGET_FILE_BYTES` each, when a job finishes.

Who calls it: `OutputDir.finish` (local) and `ObjectOutputDir.finish` (object stores). Shards still
commit one by one while the job runs (a piece is the unit of retry); the finished output is a
handful of files per kind that a single glob reads — pandas, duckdb, Spark, `datasets` — and that a
rerun does not have to open. Where each piece's rows went (file, first row, rows) is kept in
`_SUCCESS`, so the commit bookkeeping survives the rewrite.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from flashx_batch.job_errors import OutputDirError

# a consolidated file grows to about this many bytes (in memory, before compression) before the next
# one starts: large enough that a million-row job is tens of files, small enough to stream
TARGET_FILE_BYTES = 256 << 20
CONSOLIDATED = re.compile(r"part-(\d{5})\.parquet")


@dataclass
class Slice:
    """Rows [offset, offset + rows) of a consolidated file hold one piece's rows of one kind."""

    file: str
    offset: int
    rows: int

    def as_list(self) -> list[Any]:
        return [self.file, self.offset, self.rows]

    def take(self, table: pa.Table) -> pa.Table:
        """This slice's rows of `table`, the whole consolidated file."""
        return table.slice(self.offset, self.rows)


def consolidate(kind: str, pieces: list[tuple[str, Callable[[], pa.Table]]], first_index: int,
                open_sink: Callable[[str], Any], close_sink: Callable[[str, Any], None],
                empty: pa.Table | None = None, schemas: list[pa.Schema] | None = None
                ) -> tuple[list[str], dict[str, Slice]]:
    """Write `pieces` (piece id, reader of its table), in order, into `<kind>/part-NNNNN.parquet` from
    number `first_index` on; `open_sink(name)` gives a writable stream, `close_sink(name, stream)`
    makes the file durable and visible. Returns the file names and each piece's slice. With no
    rows at all and an `empty` table, one zero-row file with its schema (a glob never finds nothing).
    `schemas`: every piece's schema (from the Parquet footers), unified into the files' schema — a
    column null in one piece and typed in another, a column added by a newer version, int and float."""
    target = TARGET_FILE_BYTES  # read at call time: tests shrink it
    names: list[str] = []
    slices: dict[str, Slice] = {}
    writer: pq.ParquetWriter | None = None
    sink: Any = None
    schema: pa.Schema | None = _unified(schemas) if schemas else None
    size = rows = 0

    def close() -> None:
        nonlocal writer, sink
        if writer is not None:
            writer.close()
            close_sink(names[-1], sink)
            writer, sink = None, None

    try:
        for piece, read in pieces:
            table = read()
            schema = schema or table.schema
            table = _conform(table, schema)
            if writer is None:
                names.append(f"{kind}/part-{first_index + len(names):05d}.parquet")
                sink = open_sink(names[-1])
                writer = pq.ParquetWriter(sink, schema)
                size = rows = 0
            writer.write_table(table)
            slices[piece] = Slice(names[-1], rows, table.num_rows)
            size += table.nbytes
            rows += table.num_rows
            if size >= target:
                close()
        close()
    except BaseException:
        if writer is not None:
            writer.close()
            sink.close()
        raise
    if not names and empty is not None:
        names.append(f"{kind}/part-{first_index:05d}.parquet")
        sink = open_sink(names[0])
        pq.write_table(empty, sink)
        close_sink(names[0], sink)
    return names, slices


def pieces_table(out: Any, kind: str, committed: dict[str, dict[str, Any]],
                 columns: list[str] | None = None) -> pa.Table | None:
    """The rows of `kind` of every committed piece, in piece order, through the layout `out`'s
    `read_part` (own parts or consolidated slices); None when no piece holds that kind."""
    tables = [t for p in sorted(committed) if (t := out.read_part(kind, p, columns, committed)) is not None]
    return pa.concat_tables(tables, promote_options="permissive") if tables else None


def _unified(schemas: list[pa.Schema]) -> pa.Schema:
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise OutputDirError(f"the committed pieces' columns cannot be unified into one schema ({exc}); a "
                             "column changed type between runs. Run the job into a new output.dir.") from None


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A piece's table in the files' schema: columns it lacks are nulls, types cast (null to any,
    int to float, ...)."""
    if table.schema.equals(schema):
        return table
    try:
        columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
                   else pa.nulls(table.num_rows, f.type) for f in schema]
        return pa.Table.from_arrays(columns, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise OutputDirError(f"a committed piece does not fit the output schema ({exc}); run the job into a new "
                             "output.dir.") from None


def piece_reader(out: Any, kind: str, piece: str, committed: dict[str, dict[str, Any]]) -> Callable[[], Any]:
    """A call that reads one committed piece's `kind` table from an output directory (local or object
    store: anything with `read_part`), when `consolidate` asks for it."""
    return lambda: out.read_part(kind, piece, committed=committed)
