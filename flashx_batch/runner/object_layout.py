"""The output directory on an object store (`s3://`, `gs://`, `hdfs://`): the same layout contract as
`runner.layout.OutputDir`, with a commit protocol that needs neither rename nor locks from the store.

Who calls it: `runner.layout.open_output` picks it for a remote `output.dir`; the driver and every
worker then use it as they would the local one.

The protocol (docs/batch_jobs.md, "Object storage"):
- An attempt writes its parts under a name of its own, `_attempts/<piece>/<attempt id>/<kind>.parquet`
  (attempt id = start time in ns + random suffix), so no two writers ever share an object.
- The commit point is one manifest object naming those parts. Where the store has conditional
  puts (S3 `If-None-Match: *`) it is `_manifest/<piece>.json`, created only if absent: the first
  manifest wins, a later attempt sees it lost. Elsewhere each attempt writes the candidate
  `_manifest/<piece>/<commit id>.json` (commit id = the time it reached the commit point in ns +
  its attempt id) and the smallest commit id whose parts all exist wins — first to commit, as far
  as the writers' clocks agree, and in any case a rule every reader applies to the same listing
  with the same answer. A piece whose `_manifest/<piece>.json` exists is decided by it.
- Pieces of a split shard resolve coarsest first: a committed piece hides every committed piece
  inside it (`pieces.coarsest`), so a zombie finishing the whole shard after its halves committed
  changes which files hold the rows, never how many times a row appears.
- Finishing: the driver checks ids once per piece, consolidates the winners into few files per kind
  (`generations/part-00000.parquet`, ...), writes `_committed.json` (each piece and where its rows
  went) and `_SUCCESS` naming those files, then deletes `_attempts/` and `_manifest/`. Readers go
  through `flashx_batch.read_output`: `_SUCCESS`'s list when finished, the resolved manifests while
  running — never a listing that may hold a zombie's parts.
- The run lock is a lease object (`_lease.json`: owner, host, pid, expiry) renewed by a thread;
  another run is refused (exit 75) while it is live. Two drivers racing for a free lease are told
  apart by reading it back after a settle delay; and should both ever run, the commit rules above
  still give every row once.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flashx_batch import storage
from flashx_batch.job_errors import LockHeldError, OutputDirError, TornJobJsonError, ZombieAttemptError
from flashx_batch.runner import pieces
from flashx_batch.runner.consolidate import Slice, consolidate, piece_reader, pieces_table
from flashx_batch.runner.layout import ATTEMPTS_DIR, JOB_JSON, KINDS, MANIFEST_DIR, SUCCESS
from flashx_batch.runner.object_lease import LEASE, ObjectLease

if TYPE_CHECKING:
    from flashx_batch.runner.faults import Faults

log = logging.getLogger(__name__)
COMMITTED = "_committed.json"  # a finished job's pieces and where their rows went (written just before _SUCCESS)


class ObjectAttempt:
    """One attempt's private prefix: what `start_attempt` hands the worker and `commit` takes back."""

    def __init__(self, shard_id: str, attempt: int) -> None:
        self.shard_id, self.attempt = shard_id, attempt
        self.attempt_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"

    @property
    def prefix(self) -> str:
        return f"{ATTEMPTS_DIR}/{self.shard_id}/{self.attempt_id}"


class ObjectOutputDir:
    def __init__(self, root: str, faults: Faults | None = None, job_digest: str | None = None) -> None:
        self.root = root.rstrip("/")
        self.fs, self.base = storage.filesystem(self.root)
        self.faults = faults
        self.job_digest = job_digest
        self._lease: ObjectLease | None = None

    # ---- paths ------------------------------------------------------------------------------
    def _path(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    @property
    def job_json(self) -> str:
        return f"{self.root}/{JOB_JSON}"

    def _exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self._path(rel)).type == pafs.FileType.File

    def _read(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self._path(rel)) as fh:
            return fh.read()

    def _write(self, rel: str, data: bytes) -> None:
        """One PUT: a reader sees the whole object or none of it."""
        with self.fs.open_output_stream(self._path(rel)) as fh:
            fh.write(data)

    def _delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self._path(rel))

    def _delete_tree(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            if self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound:
                self.fs.delete_dir(self._path(rel))

    def _files(self, rel: str) -> list[str]:
        """Paths (relative to the root) of every object under `rel`."""
        infos = self.fs.get_file_info(pafs.FileSelector(self._path(rel), recursive=True, allow_not_found=True))
        base = self.base.strip("/")  # fsspec-backed listings may add a leading "/"
        return sorted(i.path.strip("/")[len(base) + 1:] for i in infos if i.type == pafs.FileType.File)

    # ---- driver side ------------------------------------------------------------------------
    def read_job(self) -> dict[str, Any] | None:
        try:
            raw = self._read(JOB_JSON)
        except FileNotFoundError:
            top = self.fs.get_file_info(pafs.FileSelector(self.base, recursive=False, allow_not_found=True))
            if any(Path(i.path).name != LEASE for i in top):
                raise OutputDirError(f"output.dir={self.root} is not empty and holds no job.json; pick an empty or "
                                     "new prefix.") from None
            return None
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TornJobJsonError(f"{self.job_json} is not valid JSON ({exc}); it was edited or damaged.") from None
        if not isinstance(record, dict):
            raise TornJobJsonError(f"{self.job_json} holds a JSON {type(record).__name__}, not a job record.")
        return record

    def lock(self) -> None:
        """Take the lease (LockHeldError while another live run holds it)."""
        try:
            self._lease = ObjectLease(self.root, self._read, self._write, self._delete)
            self._lease.acquire()
        except (LockHeldError, OutputDirError):
            raise
        except OSError as exc:
            raise OutputDirError(f"output.dir={self.root} cannot be written ({exc}); check the bucket, the "
                                 "credentials (storage.* or the environment) and the endpoint.") from None

    def unlock(self, clean: bool = False) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def reset(self) -> None:
        for rel in (*KINDS, MANIFEST_DIR, ATTEMPTS_DIR):
            self._delete_tree(rel)
        for rel in (JOB_JSON, SUCCESS, COMMITTED):
            self._delete(rel)

    def prepare(self) -> None:
        """Object stores have no directories to create."""

    def write_job(self, record: dict[str, Any]) -> None:
        if self.faults is not None:
            self.faults.fire("job_json", str(record.get("status")), 0)
        self._write(JOB_JSON, (json.dumps(record, indent=2, default=str) + "\n").encode())

    @contextlib.contextmanager
    def report_dir(self) -> Iterator[Path]:
        """A local scratch directory for report.md and its plots; each file is uploaded to the root
        when the block ends without an error."""
        with tempfile.TemporaryDirectory(prefix="flashx-report-") as tmp:
            yield Path(tmp)
            for f in sorted(Path(tmp).iterdir()):
                if f.is_file():
                    self._write(f.name, f.read_bytes())

    # ---- the finished marker ----------------------------------------------------------------
    def is_finished(self) -> bool:
        return self._exists(SUCCESS)

    def has_file(self, name: str) -> bool:
        return self._exists(name)

    def unmark_finished(self) -> None:
        self._delete(SUCCESS)

    def success_record(self) -> dict[str, Any] | None:
        try:
            return json.loads(self._read(SUCCESS))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    # ---- committed pieces -------------------------------------------------------------------
    def committed(self) -> dict[str, dict[str, Any]]:
        """piece id -> winning manifest, resolved as the module docstring says. A finished job (with
        `_SUCCESS`) answers from the list its `_SUCCESS` holds."""
        if self.is_finished():
            try:
                return json.loads(self._read(COMMITTED))
            except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
                pass  # finished before the consolidated layout: resolve the manifests
        manifests = self._files(MANIFEST_DIR)
        parts = set(self._files(ATTEMPTS_DIR))
        exact: dict[str, str] = {}
        candidates: dict[str, list[str]] = {}
        for rel in manifests:
            inner = rel[len(MANIFEST_DIR) + 1:]
            if "/" in inner:
                piece, name = inner.split("/", 1)
                candidates.setdefault(piece, []).append(name)
            elif inner.endswith(".json"):
                exact[inner[: -len(".json")]] = rel
        winners: dict[str, dict[str, Any]] = {}
        for piece in sorted(set(exact) | set(candidates)):
            manifest = self._winner(exact.get(piece), piece, sorted(candidates.get(piece, [])), parts)
            if manifest is not None:
                winners[piece] = manifest
        keep = pieces.coarsest(winners)
        return {p: winners[p] for p in keep}

    def _winner(self, exact: str | None, piece: str, names: list[str], parts: set[str]) -> dict[str, Any] | None:
        """A piece's committed manifest: the conditional-put one if it is valid, else the smallest valid
        candidate — so a manifest that can never count (another job's, or one whose parts are gone) does
        not block the piece for ever."""
        for rel in [*([exact] if exact else []), *(f"{MANIFEST_DIR}/{piece}/{n}" for n in names)]:
            manifest = self._valid_manifest(rel, parts)
            if manifest is not None:
                return manifest
        return None

    def _resolve_piece(self, piece: str) -> dict[str, Any] | None:
        """`committed()` for one piece, from its own objects only (a commit's check: no full listing)."""
        exact = f"{MANIFEST_DIR}/{piece}.json"
        mine = f"{MANIFEST_DIR}/{piece}/"
        names = [f[len(mine):] for f in self._files(f"{MANIFEST_DIR}/{piece}") if f.startswith(mine)]
        parts = set(self._files(f"{ATTEMPTS_DIR}/{piece}"))
        return self._winner(exact if self._exists(exact) else None, piece, sorted(names), parts)

    def _valid_manifest(self, rel: str, parts: set[str]) -> dict[str, Any] | None:
        try:
            manifest = json.loads(self._read(rel))
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        digest = manifest.get("job_digest")
        if self.job_digest is not None and digest is not None and digest != self.job_digest:
            return None  # a late attempt of a replaced job
        if any(p not in parts for p in manifest.get("parts", {}).values()):
            return None  # its parts were removed (cleaned as a loser, or by hand): not a commit
        return manifest

    def clean_orphans(self, committed: dict[str, dict[str, Any]]) -> int:
        """Delete manifests that can never count and attempt prefixes no `committed` manifest names
        (crashed, lost or zombie attempts)."""
        keep = {p.rsplit("/", 1)[0] for m in committed.values() for p in m.get("parts", {}).values()}
        removed = 0
        parts = set(self._files(ATTEMPTS_DIR))
        for rel in self._files(MANIFEST_DIR):  # manifests that can never count: another job's, parts gone
            if self._valid_manifest(rel, parts) is None:
                self._delete(rel)
                removed += 1
        for prefix in {"/".join(f.split("/")[:3]) for f in parts} - keep:
            self._delete_tree(prefix)
            removed += 1
        if removed:
            log.info("removed %d attempt(s) of uncommitted or superseded pieces", removed)
        return removed

    def drop_attempts_dir(self) -> None:
        """Nothing to do before consolidation: the winners' parts are the output until `finish`."""

    def read_part(self, kind: str, piece: str, columns: list[str] | None = None,
                  committed: dict[str, dict[str, Any]] | None = None) -> pa.Table | None:
        """One committed piece's rows of `kind`: its own part while the job runs, its slice of a
        consolidated file once finished; None if it has none."""
        manifest = (committed if committed is not None else self.committed()).get(piece) or {}
        rel = manifest.get("parts", {}).get(kind)
        if rel is not None:
            return pq.read_table(self._path(rel), columns=columns, filesystem=self.fs)
        where = manifest.get("slices", {}).get(kind)
        if where is None:
            return None
        return Slice(*where).take(pq.read_table(self._path(where[0]), columns=columns, filesystem=self.fs))

    def read_stats(self, committed: dict[str, dict[str, Any]] | None = None) -> pa.Table | None:
        return pieces_table(self, "stats", self.committed() if committed is None else committed)

    # ---- worker side ------------------------------------------------------------------------
    def start_attempt(self, shard_id: str, attempt: int) -> ObjectAttempt:
        if self.is_finished():
            raise ZombieAttemptError(f"{self.root} is finished (_SUCCESS); attempt {attempt} of {shard_id} is a "
                                     "zombie")
        return ObjectAttempt(shard_id, attempt)

    def discard(self, staging: ObjectAttempt) -> None:
        self._delete_tree(staging.prefix)

    def commit(self, shard_id: str, attempt: int, tables: dict[str, pa.Table], manifest: dict[str, Any],
               staging: ObjectAttempt | None = None) -> bool:
        """Write the parts under the attempt's own prefix, then the manifest: True if this attempt's
        manifest is (now) the piece's winner."""
        staging = staging or self.start_attempt(shard_id, attempt)
        parts = {}
        for kind, table in tables.items():
            rel = f"{staging.prefix}/{kind}.parquet"
            if self.faults is not None:
                self.faults.fire("write", shard_id, attempt, kind=kind)
            sink = io.BytesIO()
            pq.write_table(table, sink)
            self._write(rel, sink.getvalue())
            parts[kind] = rel
        if self.faults is not None:
            self.faults.fire("after_publish", shard_id, attempt)
            self.faults.fire("before_manifest", shard_id, attempt)
        if self.is_finished():  # the job ended while this attempt ran: it is a zombie, leave no trace
            self.discard(staging)
            return False
        commit_id = f"{time.time_ns():020d}-{staging.attempt_id}"
        record = {**manifest, "shard_id": shard_id, "attempt": attempt, "attempt_id": staging.attempt_id,
                  "commit_id": commit_id, "files": sorted(tables), "parts": parts, "job_digest": self.job_digest,
                  "committed_at": time.time()}
        data = json.dumps(record, indent=1, default=str).encode()
        won = storage.put_if_absent(f"{self.root}/{MANIFEST_DIR}/{shard_id}.json", data)
        if won is False and self._resolve_piece(shard_id) is None:
            won = None  # the manifest there can never count (another job's, parts gone): commit beside it
        if won is None:
            self._write(f"{MANIFEST_DIR}/{shard_id}/{commit_id}.json", data)
            winner = self._resolve_piece(shard_id)
            won = winner is not None and winner.get("commit_id") == commit_id
        if not won:
            log.info("%s: attempt %d lost to an earlier commit", shard_id, attempt)
        return won

    # ---- finishing --------------------------------------------------------------------------
    def finish(self, totals: dict[str, Any], committed: dict[str, dict[str, Any]],
               empty: dict[str, pa.Table]) -> None:
        """Consolidate the winners into `<kind>/part-NNNNN.parquet` (runner.consolidate), write
        `_committed.json` (each piece's manifest and slices), `_SUCCESS` (totals, the files) and delete the per-attempt
        objects. `empty`: a zero-row table per kind, written when no piece holds that kind."""
        if self._lease is not None and self._lease.lost:
            raise LockHeldError(f"{self.root}: this run lost its lease ({self._lease.lost}); it stops before "
                                "writing the final files. Rerun once the other run has finished.")
        for kind in KINDS:  # files of an earlier, interrupted consolidation
            self._delete_tree(kind)
        files: dict[str, list[str]] = {}
        where: dict[str, dict[str, list]] = {p: {} for p in committed}
        for kind in KINDS:
            mine = [p for p in sorted(committed) if kind in committed[p].get("parts", {})]
            readers = [(p, piece_reader(self, kind, p, committed)) for p in mine]
            schemas = [pq.read_schema(self._path(committed[p]["parts"][kind]), filesystem=self.fs) for p in mine]
            files[kind], slices = consolidate(kind, readers, 0, self._sink, _close_sink, empty.get(kind),
                                              schemas=schemas)
            for p, sl in slices.items():
                where[p][kind] = sl.as_list()
        pinned = {p: {**{k: v for k, v in m.items() if k != "parts"}, "slices": where[p]}
                  for p, m in committed.items()}
        self._write(COMMITTED, json.dumps(pinned, separators=(",", ":"), default=str).encode())
        self._write(SUCCESS, (json.dumps({**totals, "files": files}, indent=2, default=str) + "\n").encode())
        try:
            self.tidy()
        except OSError as exc:  # the job is finished; what is left is cleared by the next rerun
            log.warning("%s: could not remove the attempts' objects after _SUCCESS (%s); a rerun removes them",
                        self.root, exc)

    def tidy(self) -> None:
        """After `_SUCCESS`: the per-attempt objects (an interrupted finish's, or a zombie's) go, and
        any file in a kind's prefix that `_SUCCESS` does not list (another driver's, had two ever run)."""
        self._delete_tree(ATTEMPTS_DIR)
        self._delete_tree(MANIFEST_DIR)
        listed = {f for names in (self.success_record() or {}).get("files", {}).values() for f in names}
        for kind in KINDS:
            for rel in self._files(kind):
                if f"{kind}/{rel}" not in listed:
                    self._delete(f"{kind}/{rel}")

    def _sink(self, name: str) -> Any:
        return self.fs.open_output_stream(self._path(name))


def _close_sink(name: str, sink: Any) -> None:
    sink.close()  # the object appears whole when its upload completes
