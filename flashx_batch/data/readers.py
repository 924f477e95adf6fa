"""Input readers: Parquet / JSONL / CSV / Arrow files, directories, globs, `datasets` save_to_disk folders.

Who calls it: `data.preflight` (once per file, at planning time, in the driver) and
`runner.worker` (to re-read the rows of its shard: descriptors travel through Ray, rows do not).
Every reader returns a `Frame` of Python values plus the Arrow type of each column where the
format has one; JSONL has none, which is what lets a single bad value become a `bad_type` error
row instead of failing the whole file.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import hashlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flashx_batch import storage
from flashx_batch.data.jsonl import json_lines
from flashx_batch.job_errors import InputChangedError, InputError, InputUnavailableError

log = logging.getLogger(__name__)

SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl",
                  ".ndjson": "jsonl", ".csv": "csv", ".arrow": "arrow"}


@dataclass(frozen=True)
class InputFile:
    """One input file: where it is, how to read it, and what it held when planned.

    size, mtime and sha256 are the file as planned: every later read (a worker re-reading its rows,
    the driver before `_SUCCESS`) hashes the bytes it parses and refuses a file that changed, so a
    job's rows always come from one version of each file. The fingerprint leaves mtime out: touching
    a file without changing it must not block a resume."""

    path: str
    format: str
    size: int
    sha256: str
    mtime_ns: int = 0

    def manifest(self) -> dict[str, Any]:
        # The name, not the absolute path: moving a dataset directory should not invalidate a resume.
        return {"name": Path(self.path).name, "format": self.format, "size": self.size, "sha256": self.sha256}


@dataclass
class Frame:
    """Columns of one file as Python lists; `types[c]` is the Arrow type, or None when the format is untyped."""

    columns: dict[str, list[Any]]
    types: dict[str, pa.DataType | None]
    num_rows: int


def resolve_inputs(path: str, fmt: str = "auto") -> list[InputFile]:
    """Expand `data.path` into a sorted list of files; raises InputError when nothing usable is there.
    An object-store URI (s3://, gs://, hdfs://) is a file, a prefix read recursively, or a glob."""
    if storage.is_remote(path):
        return _resolve_remote(path, fmt)
    p = Path(path)
    if any(ch in path for ch in "*?["):
        files = [Path(f) for f in sorted(glob.glob(path, recursive=True)) if Path(f).is_file()]
        if not files:
            raise InputError(f"data.path={path!r}: the glob matches no files.")
    elif p.is_dir():
        files = _dir_files(p)
    elif p.is_file():
        files = [p]
    else:
        raise InputError(f"data.path={path!r}: no such file or directory.")
    out = []
    for f in files:
        f_fmt = _format_of(f, fmt)
        st = f.stat()
        if st.st_size == 0:
            raise InputError(f"{f}: empty file (0 bytes); remove it or regenerate it.")
        out.append(InputFile(str(f), f_fmt, st.st_size, _sha256(f), st.st_mtime_ns))
    return out


def _resolve_remote(path: str, fmt: str) -> list[InputFile]:
    try:
        if any(ch in path for ch in "*?["):
            found = storage.glob_files(path)
            if not found:
                raise InputError(f"data.path={path!r}: the glob matches no objects.")
        else:
            info = storage.file_info(path)
            if info.type == pafs.FileType.File:
                found = [(path, info)]
            else:
                base = path.rstrip("/")
                listed = [(u, i) for u, i in storage.list_files(base)
                          if not any(part.startswith((".", "_")) for part in u[len(base) + 1:].split("/"))]
                found = [(u, i) for u, i in listed if Path(u).suffix.lower() in SUFFIX_FORMATS]
                _log_skipped(path, [u for u, _ in listed if Path(u).suffix.lower() not in SUFFIX_FORMATS])
                if not found:
                    raise InputError(f"data.path={path!r}: no such object, and no .parquet / .jsonl / .csv / .arrow "
                                     "objects under that prefix.")
    except OSError as exc:
        raise InputError(f"data.path={path!r}: cannot list it ({str(exc).splitlines()[0]}); check the bucket, the "
                         "credentials (storage.* or the environment) and the endpoint.") from None
    out = []
    for uri, info in found:
        if info.size == 0:
            raise InputError(f"{uri}: empty object (0 bytes); remove it or regenerate it.")
        out.append(InputFile(uri, _format_of(Path(uri), fmt), info.size, _sha256(uri), info.mtime_ns or 0))
    return out


def _log_skipped(path: str, skipped: list[str]) -> None:
    """A directory's files of no format we read (`.jsonl.gz`, `.txt`, `.tsv`, ...) are not input: say so,
    naming a few, rather than leave a user wondering where their rows went."""
    if skipped:
        kinds = sorted({"".join(Path(f).suffixes).lower() or "(no suffix)" for f in skipped})
        log.warning("data.path=%s: %d file(s) skipped, of no format read here (%s; read: %s): %s%s", path,
                    len(skipped), ", ".join(kinds), " ".join(sorted(set(SUFFIX_FORMATS))),
                    ", ".join(skipped[:3]), ", ..." if len(skipped) > 3 else "")


def read_verified(file: InputFile) -> bytes:
    """The file's bytes, checked to be the bytes planned (size and sha256); InputChangedError if not.

    What is parsed is what was hashed, so a file replaced between the check and the parse cannot
    slip through."""
    try:
        data = storage.read_bytes(file.path)
    except FileNotFoundError:
        # not a bad job by itself: on a cluster this node may lack the mount (retried elsewhere)
        raise InputUnavailableError(f"{file.path}: not found on {socket.gethostname()} (removed after the job was "
                                    "planned, or not mounted on this node); input files must be readable by every "
                                    "worker.") from None
    sha256 = hashlib.sha256(data).hexdigest()
    if len(data) != file.size or sha256 != file.sha256:
        raise InputChangedError(describe_change(file, len(data), sha256))
    return data


def describe_change(file: InputFile, size: int, sha256: str) -> str:
    try:
        mtime = storage.file_info(file.path).mtime_ns or 0
    except OSError:
        mtime = 0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime / 1e9)) if mtime else "?"
    return (f"{file.path} changed after the job was planned: size {file.size} -> {size} bytes, sha256 "
            f"{file.sha256[:12]} -> {sha256[:12]}, modified {when}. A job reads one "
            "version of each input file; the rows committed so far came from the planned version. Leave input "
            "files unchanged while a job runs; to use the new version, run the job into a new output.dir.")


def verify_unchanged(files: list[InputFile]) -> None:
    """Every input file still holds what was planned (the driver's last check before `_SUCCESS`;
    streamed, so a large input is hashed without being held in memory)."""
    for f in files:
        info = storage.file_info(f.path)
        if info.type != pafs.FileType.File:
            raise InputChangedError(f"{f.path} was removed while the job ran; the rows committed came from the "
                                    "planned version. Restore it, or run the job into a new output.dir.")
        size, sha256 = info.size, _sha256(f.path)
        if size != f.size or sha256 != f.sha256:
            raise InputChangedError(describe_change(f, size, sha256))


def _dir_files(d: Path) -> list[Path]:
    if (d / "dataset_dict.json").is_file():
        splits = _marker(d / "dataset_dict.json").get("splits") or ["train"]
        example = d / str(splits[0] if isinstance(splits, list) else "train")
        raise InputError(f"{d} is a `datasets` DatasetDict; point data.path at one split, e.g. {example}.")
    if (d / "state.json").is_file():  # `Dataset.save_to_disk`: Arrow IPC stream shards listed in state.json
        entries = _marker(d / "state.json").get("_data_files", [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("filename"), str)
                                                    for e in entries):
            raise InputError(f"{d / 'state.json'}: `_data_files` is not a list of {{filename}} entries; the "
                             "`datasets` folder is damaged (save it again), or remove state.json.")
        files = [d / entry["filename"] for entry in entries]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{d}/state.json lists missing data files: {', '.join(missing)}.")
        return files
    listed = sorted(f for f in d.rglob("*") if f.is_file() and not _hidden(f, d))
    files = [f for f in listed if f.suffix.lower() in SUFFIX_FORMATS]
    _log_skipped(str(d), [str(f) for f in listed if f.suffix.lower() not in SUFFIX_FORMATS])
    if not files:
        raise InputError(f"data.path={str(d)!r}: the directory holds no .parquet / .jsonl / .csv / .arrow files.")
    return files


def _marker(path: Path) -> dict[str, Any]:
    """A `datasets` marker file (state.json, dataset_dict.json) as a dict; InputError if it is not one."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InputError(f"{path}: not valid JSON ({str(exc)[:80]}); the `datasets` folder is damaged (save it "
                         "again), or remove the file if the folder holds plain data files.") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: holds a JSON {type(value).__name__}, not the object `datasets` writes; save the "
                         "dataset again, or remove the file.")
    return value


def _hidden(f: Path, root: Path) -> bool:
    return any(part.startswith((".", "_")) for part in f.relative_to(root).parts)


def _format_of(f: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if f.suffix.lower() not in SUFFIX_FORMATS:
        raise InputError(f"{f}: cannot tell the format from the suffix; set data.format=parquet|jsonl|csv|arrow.")
    return SUFFIX_FORMATS[f.suffix.lower()]


def _sha256(path: str | Path) -> str:
    """sha256 of a local file or an object, streamed (never the whole file in memory)."""
    fs, inner = storage.filesystem(str(path))
    digest = hashlib.sha256()
    with fs.open_input_stream(inner) as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def read_frame(file: InputFile, columns: list[str], text_column: str | None = None) -> Frame:
    """Read `columns` of one file; raises InputError naming the file (and column / line) on any problem,
    InputChangedError if the file no longer holds what was planned.

    `text_column` (the prompt or messages column) is read leniently where the format is text (CSV):
    invalid UTF-8 there becomes that row's `invalid_text` error, not a failure of the file."""
    data = read_verified(file)
    try:
        if file.format == "jsonl":
            return _read_jsonl(file.path, data, columns)
        if file.format == "openai_batch":  # one request per line, read as fixed columns (data.openai_batch)
            from flashx_batch.data import openai_batch

            values = openai_batch.parse(file.path, data)
            _check_header(file, list(values), columns)
            return Frame({c: values[c] for c in columns}, {c: None for c in columns}, len(values["custom_id"]))
        table = _read_arrow_table(file, data, columns, text_column)
    except (InputError, MemoryError):  # running out of memory is the machine's state, not the file's
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise InputError(f"{file.path}: cannot read as {file.format}: {str(exc).splitlines()[0]}") from None
    _check_header(file, table.column_names, columns)
    table = table.select(columns)
    values = {c: table.column(c).to_pylist() for c in columns}
    types = {c: table.schema.field(c).type for c in columns}
    if file.format == "csv" and text_column in values:
        # surrogateescape keeps invalid bytes visible, so validation flags just that row (as for JSONL)
        values[text_column] = [v.decode("utf-8", errors="surrogateescape") if isinstance(v, bytes) else v
                               for v in values[text_column]]
        types[text_column] = pa.string()
    return Frame(values, types, table.num_rows)


def iter_frames(file: InputFile, columns: list[str], text_column: str | None = None,
                batch_rows: int = 65536, values: list[str] | None = None) -> Iterator[Frame]:
    """`read_frame` in pieces of at most `batch_rows` rows, in order: a Parquet file is read with
    random access and decoded one batch at a time (memory: a batch, whatever the file's size), checked
    against the plan by size and modification time before and after (`_open_checked`); other formats
    are parsed whole and handed out as one frame. `values`: the columns whose values a Parquet frame
    carries (default all; every column's type is there either way)."""
    if file.format != "parquet":  # parsed whole anyway: one frame (untyped JSONL is typed per file)
        yield read_frame(file, columns, text_column)
        return
    with _parquet_errors(file):
        fs, path = _open_checked(file)
        with fs.open_input_file(path) as handle:
            reader = pq.ParquetFile(handle)
            names = reader.schema_arrow.names
            _check_header(file, names, columns)
            types = {c: reader.schema_arrow.field(c).type for c in columns}
            wanted = [c for c in columns if values is None or c in values]
            for batch in reader.iter_batches(batch_size=batch_rows, columns=wanted):
                yield Frame({c: batch.column(c).to_pylist() for c in wanted}, types, batch.num_rows)
        _open_checked(file)  # not replaced while it was read


@contextlib.contextmanager
def _parquet_errors(file: InputFile) -> Iterator[None]:
    """A Parquet file read with random access: a missing file is this node's problem (retried
    elsewhere), anything Arrow or the filesystem raises names the file."""
    try:
        yield
    except FileNotFoundError:
        raise InputUnavailableError(f"{file.path}: not found on {socket.gethostname()} (removed after the job was "
                                    "planned, or not mounted on this node); input files must be readable by every "
                                    "worker.") from None
    except (InputError, InputChangedError, MemoryError):
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise InputError(f"{file.path}: cannot read as parquet: {str(exc).splitlines()[0]}") from None


def _open_checked(file: InputFile) -> tuple[pafs.FileSystem, str]:
    """The file's filesystem and path, after checking it still has the planned size and modification
    time; a file only touched since (same size, new time) is hashed again, once per process.
    FileNotFoundError if it is gone, InputChangedError if it changed."""
    fs, path = storage.filesystem(file.path)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(file.path)
    mtime = info.mtime_ns or 0
    if info.size != file.size:
        raise InputChangedError(describe_change(file, info.size or 0, "(not read)"))
    if file.mtime_ns and mtime and mtime != file.mtime_ns and _verified_at.get(file.path) != mtime:
        digest = _sha256(file.path)  # touched since planning: unchanged only if it still hashes the same
        if digest != file.sha256:
            raise InputChangedError(describe_change(file, info.size, digest))
        _verified_at[file.path] = mtime
    return fs, path


_verified_at: dict[str, int] = {}  # path -> the modification time this process last hashed it at


def read_rows(file: InputFile, columns: list[str], rows: list[int]) -> tuple[Frame, dict[int, int]]:
    """Only the Parquet row groups holding `rows` (row indices of the file, any order), opened with
    random access (a local file, or ranged GETs on an object store) -> (a frame of those rows, row
    index -> position in it). A worker's shard of 16 rows then reads one row group, not the file.

    What is read is checked against the plan by size and modification time (a whole-file hash would
    mean reading the whole file); the driver hashes every file again before `_SUCCESS`, so a file
    changed in any other way still fails the job instead of mixing versions."""
    with _parquet_errors(file):
        fs, path = _open_checked(file)
        with fs.open_input_file(path) as handle:
            reader = pq.ParquetFile(handle)
            _check_header(file, reader.schema_arrow.names, columns)
            starts, total = [], 0
            for g in range(reader.num_row_groups):
                starts.append(total)
                total += reader.metadata.row_group(g).num_rows
            wanted = sorted(set(rows))
            if wanted and (wanted[0] < 0 or wanted[-1] >= total):
                raise InputChangedError(f"{file.path} has {total} rows, row {wanted[-1]} was planned; it changed after "
                                        "the job was planned.")
            groups = sorted({bisect.bisect_right(starts, r) - 1 for r in wanted})
            table = reader.read_row_groups(groups, columns=columns) if groups else reader.schema_arrow.empty_table()
    first = {}  # row group -> its first row's position in `table`
    at = 0
    for g in groups:
        first[g] = at
        at += reader.metadata.row_group(g).num_rows
    position = {}
    take = []
    for r in wanted:
        g = bisect.bisect_right(starts, r) - 1
        position[r] = len(take)
        take.append(first[g] + r - starts[g])
    picked = table.take(pa.array(take, pa.int64())) if take else table.slice(0, 0)
    frame = Frame({c: picked.column(c).to_pylist() for c in columns},
                  {c: picked.schema.field(c).type for c in columns}, picked.num_rows)
    return frame, position


class MissingColumns(InputError):
    """A file lacks columns the job reads. `data.preflight` adds which setting named each one."""

    def __init__(self, path: str, missing: list[str], present: list[str]) -> None:
        self.path, self.missing, self.present = path, list(missing), list(present)
        super().__init__(f"{path}: missing column(s) {', '.join(missing)}; it has "
                         f"{', '.join(present) or 'none'}.")


def _check_header(file: InputFile, names: list[str], columns: list[str]) -> None:
    twice = sorted({c for c in columns if names.count(c) > 1})
    if twice:
        raise InputError(f"{file.path}: column(s) {', '.join(map(repr, twice))} appear more than once in the "
                         "header; give every column a distinct name.")
    missing = [c for c in columns if c not in names]
    if missing:
        raise MissingColumns(file.path, missing, names)


def _read_arrow_table(file: InputFile, data: bytes, columns: list[str], text_column: str | None) -> pa.Table:
    source = pa.BufferReader(data)
    if file.format == "parquet":
        return pq.read_table(source)
    if file.format == "csv":
        # CSV is text: the columns we read stay strings (an id like "007" must not become 7); the
        # text column stays bytes until read_frame decodes it leniently.
        types = {c: pa.binary() if c == text_column else pa.string() for c in columns}
        return pacsv.read_csv(source, convert_options=pacsv.ConvertOptions(column_types=types))
    if file.format == "arrow":
        try:
            return pa.ipc.open_stream(source).read_all()  # datasets' save_to_disk writes streams
        except pa.ArrowInvalid:
            return pa.ipc.open_file(pa.BufferReader(data)).read_all()
    raise InputError(f"{file.path}: unknown format {file.format!r}.")


def _read_jsonl(path: str, data: bytes, columns: list[str]) -> Frame:
    values: dict[str, list[Any]] = {c: [] for c in columns}
    seen: set[str] = set()
    for lineno, record in json_lines(path, data):
        if not isinstance(record, dict):
            raise InputError(f"{path}:{lineno}: expected a JSON object per line, got {type(record).__name__}.")
        seen.update(record)
        for c in columns:
            values[c].append(record.get(c))
    missing = [c for c in columns if c not in seen]
    if missing:
        raise MissingColumns(path, missing, sorted(seen))
    n = len(values[columns[0]]) if columns else 0
    return Frame(values, {c: None for c in columns}, n)
