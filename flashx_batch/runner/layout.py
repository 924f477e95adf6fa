"""The output directory (README "Output"; docs/batch_jobs.md "Output layout and exactly-once") and
its commit protocol.

Who calls it: the driver (`runner.job`) to open, lock, resume, clean and finish a job; every worker
(`runner.worker`, in-process or in a Ray actor) to commit one shard. A shard is committed when
`_manifest/<shard>.json` exists; the manifest is hard-linked into place last, which is atomic and
exclusive (EEXIST if another attempt won), so a crash at any instant leaves either a committed
shard or files that `clean_orphans` removes on resume. That is the whole of exactly-once.
A commit is `stage` (write + fsync in a private attempt directory) then `publish` (rename + link,
under a lock on `_manifest/`, refusing any piece that overlaps a committed one: see runner.pieces).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flashx_batch.job_errors import LockHeldError, OutputDirError, TornJobJsonError, ZombieAttemptError
from flashx_batch.runner import pieces
from flashx_batch.runner.consolidate import CONSOLIDATED, Slice, consolidate, piece_reader, pieces_table
from flashx_batch.runner.durable import fsync_path, link_exclusive, write_atomic

if TYPE_CHECKING:
    from flashx_batch.runner.faults import Faults

log = logging.getLogger(__name__)
KINDS = ("generations", "errors", "stats")
JOB_JSON, SUCCESS, MANIFEST_DIR, ATTEMPTS_DIR, LOCK = "job.json", "_SUCCESS", "_manifest", "_attempts", "_lock"


class OutputDir:
    def __init__(self, root: str | Path, faults: Faults | None = None, job_digest: str | None = None) -> None:
        """`faults`: armed fault hooks (tests); None in production, and then no hook is called.
        `job_digest`: the fingerprint digest of the job this process writes for, stamped on every
        manifest it commits, so a late attempt of an earlier, replaced job is recognised as foreign."""
        self.root = Path(root)
        # the same file addressing as the object-store layout's (readers that take either: read_output)
        self.fs, self.base = pafs.LocalFileSystem(), str(self.root)
        self.faults = faults
        self.job_digest = job_digest
        self._lock_fd: int | None = None
        self._slice_file: tuple[tuple, pa.Table] | None = None  # the consolidated file read last
        self._created: list[Path] = []  # what lock() created (removed again by a run that wrote nothing)

    # ---- paths ------------------------------------------------------------------------------
    def part(self, kind: str, shard_id: str) -> Path:
        return self.root / kind / f"part-{shard_id}.parquet"

    def manifest(self, shard_id: str) -> Path:
        return self.root / MANIFEST_DIR / f"{shard_id}.json"

    @property
    def job_json(self) -> Path:
        return self.root / JOB_JSON

    # ---- driver side ------------------------------------------------------------------------
    def read_job(self) -> dict[str, Any] | None:
        """job.json of an existing job, None for a new or empty directory; OutputDirError if not ours,
        TornJobJsonError if job.json cannot be read as a job record."""
        if self.job_json.is_file():
            try:
                record = json.loads(self.job_json.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TornJobJsonError(f"{self.job_json} is not valid JSON ({exc}); it was cut short or edited.") \
                    from None
            if not isinstance(record, dict):
                raise TornJobJsonError(f"{self.job_json} holds a JSON {type(record).__name__}, not a job record.")
            return record
        if self.root.exists() and any(p.name != LOCK for p in self.root.iterdir()):
            raise OutputDirError(f"output.dir={self.root} is not empty and holds no job.json; "
                                 "pick an empty or new directory.")
        return None

    def lock(self) -> None:
        """Take the directory's run lock (released by the kernel even on SIGKILL). LockHeldError if a
        live run holds it, OutputDirError if the directory cannot be created or written (a file in
        the way, a read-only filesystem, no permission). Everything that reads or decides on job.json
        happens after this, so two runs never both decide on an empty directory."""
        if self.root.exists() and not self.root.is_dir():
            raise OutputDirError(f"output.dir={self.root} is a file, not a directory; pick a directory path.")
        self._created = [] if self.root.exists() else [self.root]
        if not (self.root / LOCK).exists():
            self._created.insert(0, self.root / LOCK)
        for _ in range(3):
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise OutputDirError(f"output.dir={self.root} cannot be written ({exc.strerror or exc}); pick a "
                                     "directory this user can write to, on a writable filesystem.") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LockHeldError(f"another run is writing to {self.root} (it holds {self.root / LOCK}); try "
                                    "again once it has finished.") from None
            # a refused run removes the lock file it created: a lock taken on that unlinked file is no lock
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == os.stat(self.root / LOCK).st_ino:
                    self._lock_fd = fd
                    return
            os.close(fd)
        raise LockHeldError(f"{self.root / LOCK} keeps being replaced by other runs; try again later.")

    def unlock(self, clean: bool = False) -> None:
        """Release the lock. `clean`: this run wrote nothing, so remove the lock file and directory if
        it created them (a refused job leaves no trace, not even in a directory that is not ours)."""
        if self._lock_fd is not None:
            if clean:
                with contextlib.suppress(OSError):
                    for path in self._created:
                        path.rmdir() if path.is_dir() else path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = None

    def reset(self) -> None:
        """Remove every file of the layout but the lock (a job that committed no generated row, replaced by a
        corrected run)."""
        for name in (*KINDS, MANIFEST_DIR, ATTEMPTS_DIR):
            shutil.rmtree(self.root / name, ignore_errors=True)
        for name in (JOB_JSON, SUCCESS):
            (self.root / name).unlink(missing_ok=True)
        for tmp in self.root.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def prepare(self) -> None:
        for d in (*KINDS, MANIFEST_DIR, ATTEMPTS_DIR):
            (self.root / d).mkdir(parents=True, exist_ok=True)

    def write_job(self, record: dict[str, Any]) -> None:
        """Replace job.json atomically. On a full disk a final status (not `running`) falls back to
        rewriting the file in place: a compact record padded with spaces to the old size, so no new
        block is needed and the room stays for the next such write. The error is raised either way,
        for the caller to report."""
        text = json.dumps(record, indent=2, default=str) + "\n"
        try:
            if self.faults is not None:
                self.faults.fire("job_json", str(record.get("status")), 0)
            write_atomic(self.job_json, text)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or record.get("status") == "running" \
                    or not self.job_json.is_file():
                raise
            compact = json.dumps(record, separators=(",", ":"), default=str).encode()
            size = self.job_json.stat().st_size
            if len(compact) > size:
                raise  # writing past the old size needs new blocks: it would tear the file
            with contextlib.suppress(OSError), open(self.job_json, "r+b") as fh:
                fh.write(compact + b" " * (size - len(compact)))
                fh.flush()
                os.fsync(fh.fileno())
            raise

    def committed(self) -> dict[str, dict[str, Any]]:
        """shard id -> manifest, for every shard whose manifest and files are all present and which was
        written for this job (a manifest stamped with another job's digest is un-committed: a late
        attempt of a replaced job; unstamped manifests are from before stamping and kept)."""
        out: dict[str, dict[str, Any]] = {}
        mdir = self.root / MANIFEST_DIR
        if not mdir.is_dir():
            return out
        seen: dict[str, bool] = {}  # consolidated file -> exists (each stat once)
        for m in sorted(mdir.glob("*.json")):
            try:
                manifest = json.loads(m.read_text())
            except json.JSONDecodeError:  # only the no-hard-link fallback can leave a torn manifest
                log.warning("shard %s: unreadable manifest; it will be redone", m.stem)
                m.unlink()
                continue
            digest = manifest.get("job_digest")
            if self.job_digest is not None and digest is not None and digest != self.job_digest:
                log.warning("shard %s: committed by a run of another job (%s); it will be redone", m.stem, digest)
                m.unlink()
                continue
            missing = [k for k in manifest["files"] if not self._holds(manifest, k, seen)]
            if missing:  # someone deleted committed files: un-commit, the shard will be redone
                log.warning("shard %s: manifest present but %s missing; it will be redone", m.stem, missing)
                m.unlink()
                continue
            out[manifest["shard_id"]] = manifest
        return out

    def _holds(self, manifest: dict[str, Any], kind: str, seen: dict[str, bool]) -> bool:
        """Whether the file holding a manifest's rows of `kind` is there: its own part, or (once the
        job finished) the consolidated file its slice is in."""
        where = manifest.get("slices", {}).get(kind)
        if where is None:
            return self.part(kind, manifest["shard_id"]).is_file()
        if where[0] not in seen:
            seen[where[0]] = (self.root / where[0]).is_file()
        return seen[where[0]]

    def clean_orphans(self, committed: dict[str, dict[str, Any]], keep: frozenset[str] = frozenset()) -> int:
        """Remove attempt directories, part files no `committed` manifest names, and consolidated files
        none points into (but `keep`: a kind's zero-row file); returns files removed."""
        removed = 0
        referenced = {m["slices"][k][0] for m in committed.values() for k in m.get("slices", {})} | keep
        # a piece's own part is live until its rows moved into a consolidated file
        own = {(k, p) for p, m in committed.items() for k in m["files"] if k not in m.get("slices", {})}
        attempts = self.root / ATTEMPTS_DIR
        if attempts.is_dir():
            for a in attempts.iterdir():
                shutil.rmtree(a, ignore_errors=True)
                removed += 1
        for kind in KINDS:
            for f in (self.root / kind).glob("part-*.parquet"):
                consolidated = CONSOLIDATED.fullmatch(f.name) is not None
                if (f"{kind}/{f.name}" not in referenced) if consolidated else \
                        ((kind, f.name[len("part-"):-len(".parquet")]) not in own):
                    f.unlink()
                    removed += 1
        for tmp in [*self.root.glob(".*.tmp"), *(self.root / MANIFEST_DIR).glob(".*.tmp")]:
            tmp.unlink()
        if removed:
            log.info("removed %d file(s) / attempt dir(s) no commit points to (crashed or lost attempts, parts "
                     "folded into the consolidated files)", removed)
        return removed

    def drop_attempts_dir(self) -> None:
        """After the last commit: the (empty) staging area is not part of the finished layout."""
        shutil.rmtree(self.root / ATTEMPTS_DIR, ignore_errors=True)

    # ---- what the driver and the readers share with the object-store layout (runner.object_layout) ----
    def is_finished(self) -> bool:
        return (self.root / SUCCESS).is_file()

    def has_file(self, name: str) -> bool:
        """Whether the directory holds the top-level file `name` (report.md, a batch output file)."""
        return (self.root / name).is_file()

    def unmark_finished(self) -> None:
        (self.root / SUCCESS).unlink(missing_ok=True)

    def success_record(self) -> dict[str, Any] | None:
        try:
            record = json.loads((self.root / SUCCESS).read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return record if isinstance(record, dict) else None

    def finish(self, totals: dict[str, Any], committed: dict[str, dict[str, Any]],
               empty: dict[str, pa.Table]) -> None:
        """Few files, then `_SUCCESS`: every piece's own part files and every consolidated file that
        also holds rows of pieces no longer committed are rewritten into new consolidated files
        (`runner.consolidate`; files whose rows are all still committed are kept as they are), each
        rewritten piece's manifest is pointed at its slices, the old files go, `_SUCCESS` last.
        A crash at any step leaves manifests that each name files that exist: the rerun finishes."""
        self.clean_orphans(committed)  # consolidated files of an interrupted finish nobody points into
        files: dict[str, list[str]] = {}
        moved: dict[str, dict[str, list]] = {}
        for kind in KINDS:
            kept, redo = self._consolidated_split(kind, committed)
            existing = [int(m.group(1)) for f in (self.root / kind).glob("part-*.parquet")
                        if (m := CONSOLIDATED.fullmatch(f.name))]
            first = max(existing, default=-1) + 1
            readers = [(p, piece_reader(self, kind, p, committed)) for p in sorted(redo)]
            schemas = [self._schema(kind, p, committed) for p in sorted(redo)]
            schemas += [pq.read_schema(self.root / f) for f in kept]
            new, slices = consolidate(kind, readers, first, self._sink, self._close_sink,
                                      empty.get(kind) if not kept else None, schemas=schemas)
            for p, sl in slices.items():
                moved.setdefault(p, {})[kind] = sl.as_list()
            files[kind] = sorted(kept) + new
        with self._publish_lock():
            for p, where in moved.items():
                record = {**committed[p], "slices": {**committed[p].get("slices", {}), **where}}
                write_atomic(self.manifest(p), json.dumps(record, indent=1, default=str))
                committed[p] = record
        # the parts and files the new slices replace (the files just written stay, zero-row ones too)
        self.clean_orphans(committed, frozenset(f for names in files.values() for f in names))
        write_atomic(self.root / SUCCESS, json.dumps({**totals, "files": files}, indent=2, default=str) + "\n")

    def _consolidated_split(self, kind: str, committed: dict[str, dict[str, Any]]) -> tuple[set[str], set[str]]:
        """(consolidated files of `kind` to keep as they are, pieces whose rows of `kind` must be
        written anew: those in their own part, and those in a file that also holds dead rows)."""
        holders: dict[str, set[str]] = {}
        redo = set()
        for p, m in committed.items():
            if kind not in m["files"]:
                continue
            where = m.get("slices", {}).get(kind)
            if where is None:
                redo.add(p)
            else:
                holders.setdefault(where[0], set()).add(p)
        kept = set()
        for f, owners in holders.items():
            rows = pq.ParquetFile(self.root / f).metadata.num_rows
            if sum(committed[p]["slices"][kind][2] for p in owners) == rows:
                kept.add(f)
            else:  # a piece in it was un-committed since (deleted, another job's): rewrite the live rows
                redo |= owners
        return kept, redo

    def _sink(self, name: str) -> Any:
        tmp = self.root / f".{Path(name).name}.{uuid.uuid4().hex[:8]}.tmp"
        fh = open(tmp, "wb")  # noqa: SIM115 (closed by _close_sink, or by consolidate on an error)
        fh.tmp = tmp  # type: ignore[attr-defined]
        return fh

    def _close_sink(self, name: str, sink: Any) -> None:
        sink.flush()
        os.fsync(sink.fileno())
        sink.close()
        os.replace(sink.tmp, self.root / name)
        fsync_path((self.root / name).parent)

    @contextlib.contextmanager
    def report_dir(self) -> Iterator[Path]:
        """Where report.md and its plots are written: the directory itself."""
        yield self.root

    def discard(self, staging: Path) -> None:
        """An attempt that failed: its staging directory goes at once (a full disk gets its space back)."""
        shutil.rmtree(staging, ignore_errors=True)

    def read_part(self, kind: str, piece: str, columns: list[str] | None = None,
                  committed: dict[str, dict[str, Any]] | None = None) -> pa.Table | None:
        """One committed piece's table of `kind`: its own part file, or its slice of a consolidated
        file once the job finished (None if the piece has none)."""
        manifest = (committed if committed is not None else self.committed()).get(piece)
        if manifest is None or kind not in manifest["files"]:
            return None
        where = manifest.get("slices", {}).get(kind)
        if where is None:
            return pq.read_table(self.part(kind, piece), columns=columns)
        key = (where[0], tuple(columns) if columns else None)
        if self._slice_file is None or self._slice_file[0] != key:  # pieces of one file come in a row
            self._slice_file = (key, pq.read_table(self.root / where[0], columns=columns))
        return Slice(*where).take(self._slice_file[1])

    def _schema(self, kind: str, piece: str, committed: dict[str, dict[str, Any]]) -> pa.Schema:
        where = committed[piece].get("slices", {}).get(kind)
        return pq.read_schema(self.part(kind, piece) if where is None else self.root / where[0])

    def read_ids(self, kind: str, shard_ids: set[str]) -> Counter:
        counts: Counter = Counter()
        committed = self.committed()
        for s in shard_ids:
            table = self.read_part(kind, s, ["id"], committed)
            if table is not None:
                counts.update(table.column("id").to_pylist())
        return counts

    def read_stats(self, committed: dict[str, dict[str, Any]] | None = None) -> pa.Table | None:
        """The committed pieces' stats rows (from their parts, or their slices once finished)."""
        return pieces_table(self, "stats", self.committed() if committed is None else committed)

    # ---- worker side ------------------------------------------------------------------------
    def start_attempt(self, shard_id: str, attempt: int) -> Path:
        """The private directory one attempt of a shard writes into before committing.

        Refused once the job has `_SUCCESS`: a zombie attempt outliving its job must not leave even an
        empty staging directory in a finished layout (a rerun with work to do removes `_SUCCESS` first)."""
        if (self.root / SUCCESS).exists():
            raise ZombieAttemptError(f"{self.root} is finished (_SUCCESS); attempt {attempt} of {shard_id} is a zombie")
        staging = self.root / ATTEMPTS_DIR / f"{shard_id}.{attempt}.{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        return staging

    def commit(self, shard_id: str, attempt: int, tables: dict[str, pa.Table], manifest: dict[str, Any],
               staging: Path | None = None) -> bool:
        """Write `tables` (kind -> table) for a piece and commit them; False if it was already committed."""
        staging = self.stage(shard_id, attempt, tables, manifest, staging)
        return self.publish(shard_id, attempt, staging)

    def stage(self, shard_id: str, attempt: int, tables: dict[str, pa.Table], manifest: dict[str, Any],
              staging: Path | None = None) -> Path:
        """Write and fsync the files of one attempt in its private directory (the slow, unlocked half)."""
        staging = staging or self.start_attempt(shard_id, attempt)
        for kind, table in tables.items():
            path = staging / f"{kind}.parquet"
            if self.faults is not None:
                self._fire_write(shard_id, attempt, kind, path, table)
            pq.write_table(table, path)
            fsync_path(path)
        record = {**manifest, "shard_id": shard_id, "attempt": attempt, "files": sorted(tables),
                  "job_digest": self.job_digest}
        with open(staging / "manifest.json", "w") as fh:
            json.dump(record, fh, indent=1, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_path(staging)
        return staging

    def publish(self, shard_id: str, attempt: int, staging: Path) -> bool:
        """Move a staged attempt into place and link its manifest; False if it lost to another attempt.

        Under the `_manifest/` lock, so a check-then-rename cannot interleave with another publisher:
        the attempt loses if this piece, or any piece sharing its rows (a split half, or the whole
        shard it was split from, finished by a zombie attempt), is already committed.
        """
        files = json.loads((staging / "manifest.json").read_text())["files"]
        with self._publish_lock():
            if self._overlapping(shard_id):  # keep the winner's files untouched
                shutil.rmtree(staging, ignore_errors=True)
                return False
            for i, kind in enumerate(files):
                os.replace(staging / f"{kind}.parquet", self.part(kind, shard_id))
                if i == 0 and self.faults is not None:  # a crash here leaves a half-published piece
                    self.faults.fire("after_publish", shard_id, attempt)
            for kind in files:
                fsync_path(self.root / kind)
            if self.faults is not None:
                self.faults.fire("before_manifest", shard_id, attempt)
            won = link_exclusive(staging / "manifest.json", self.manifest(shard_id))
            fsync_path(self.root / MANIFEST_DIR)
        shutil.rmtree(staging, ignore_errors=True)
        return won

    def _overlapping(self, shard_id: str) -> list[str]:
        root = pieces.root_of(shard_id)
        mdir = self.root / MANIFEST_DIR
        present = [p.stem for p in [mdir / f"{root}.json", *mdir.glob(f"{root}{pieces.SEP}*.json")] if p.is_file()]
        return [c for c in present if pieces.overlaps(c, shard_id)]

    @contextlib.contextmanager
    def _publish_lock(self) -> Iterator[None]:
        # flock on the directory itself: no lock file in the layout, and the kernel drops it when a
        # publisher is SIGKILLed, so a crash mid-publish never blocks the retry.
        fd = os.open(self.root / MANIFEST_DIR, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _fire_write(self, shard_id: str, attempt: int, kind: str, path: Path, table: pa.Table) -> None:
        try:
            self.faults.fire("write", shard_id, attempt, kind=kind)
        except OSError:
            path.write_bytes(b"PAR1" + b"\0" * 64)  # what a disk that filled mid-write leaves: a torn file
            raise
