"""The object-store commit protocol (runner/object_layout.py) against a real S3-compatible server:
first manifest wins (conditional put) or the deterministic tie-break (without it), split pieces
resolve coarsest first, crashed and zombie attempts leave nothing that counts, the lease keeps a
second driver out, and a finished job is a few consolidated files that `read_output` returns."""

from __future__ import annotations

import dataclasses
import json
import os

import pyarrow as pa
import pytest
from s3_support import make_bucket, objects, s3_server

from flashx_batch import read_output, storage
from flashx_batch.job_errors import LockHeldError, ZombieAttemptError
from flashx_batch.runner import consolidate, object_layout, object_lease
from flashx_batch.runner.object_layout import ObjectOutputDir
from flashx_batch.runner.outputs import open_output


@pytest.fixture(scope="module")
def bucket():
    with s3_server():
        yield make_bucket("unit")


@pytest.fixture(params=[True, False], ids=["conditional_put", "tie_break"])
def out(request, bucket, monkeypatch):
    storage.configure(storage.StorageSettings(conditional_put=request.param))
    monkeypatch.setattr(object_lease, "_SETTLE_S", 0.05)
    root = f"{bucket}/{request.node.name.replace('[', '-').replace(']', '')}"
    o = open_output(root, job_digest="d1")
    assert isinstance(o, ObjectOutputDir)
    o.write_job({"status": "running"})
    yield o
    storage.configure(None)


def _tables(ids):
    gen = pa.table({"id": pa.array(ids, pa.int64()), "generated_text": [f"t{i}" for i in ids]})
    return {"generations": gen, "stats": pa.table({"shard_id": ["s"], "rows": [len(ids)]})}


def _commit(o, piece, attempt, ids):
    return o.commit(piece, attempt, _tables(ids), {"kind": "generate", "rows": len(ids), "rows_failed": 0})


def test_first_commit_wins_and_the_loser_counts_nowhere(out):
    assert _commit(out, "b00-s0000", 1, [1, 2, 3]) is True
    assert _commit(out, "b00-s0000", 2, [1, 2, 3]) is False
    committed = out.committed()
    assert list(committed) == ["b00-s0000"] and committed["b00-s0000"]["attempt"] == 1
    ids = read_output(out.root).to_table().column("id").to_pylist()
    assert sorted(ids) == [1, 2, 3]
    assert out.clean_orphans(committed) == 1  # the loser's parts
    assert sorted(read_output(out.root).to_table().column("id").to_pylist()) == [1, 2, 3]


def test_attempt_without_manifest_is_not_committed(out, monkeypatch):
    staging = out.start_attempt("b00-s0001", 1)
    monkeypatch.setattr(storage, "put_if_absent", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        out.commit("b00-s0001", 1, _tables([7]), {"rows": 1}, staging)
    monkeypatch.undo()
    assert any(f.startswith(f"_attempts/b00-s0001/{staging.attempt_id}") for f in objects(out.root))
    assert "b00-s0001" not in out.committed()
    out.clean_orphans({})
    assert not any(f.startswith("_attempts/") for f in objects(out.root))


def test_manifest_naming_removed_parts_is_no_commit(out):
    assert _commit(out, "b00-s0002", 1, [5])
    manifest = out.committed()["b00-s0002"]
    out.fs.delete_file(f"{out.base}/{manifest['parts']['generations']}")
    assert "b00-s0002" not in out.committed()


def test_split_pieces_resolve_coarsest_first(out):
    assert _commit(out, "b01-s0000~0", 1, [1, 2])
    assert _commit(out, "b01-s0000~1", 1, [3, 4])
    assert set(out.committed()) == {"b01-s0000~0", "b01-s0000~1"}
    assert _commit(out, "b01-s0000", 3, [1, 2, 3, 4])  # a zombie finished the whole shard late
    assert set(out.committed()) == {"b01-s0000"}
    assert sorted(read_output(out.root).to_table().column("id").to_pylist()) == [1, 2, 3, 4]


def test_manifest_of_another_job_is_ignored(out):
    other = open_output(out.root, job_digest="d0")
    assert _commit(other, "b02-s0000", 1, [9])
    assert "b02-s0000" not in out.committed()


def test_tie_break_is_the_smallest_commit_id(bucket, monkeypatch):
    """Without conditional puts, a commit stamped earlier (a writer whose clock runs behind) wins even
    when its manifest lands second — and every reader agrees on it."""
    storage.configure(storage.StorageSettings(conditional_put=False))
    try:
        o = open_output(f"{bucket}/tie", job_digest="d1")
        o.write_job({"status": "running"})
        assert _commit(o, "p", 2, [1]) is True
        monkeypatch.setattr(object_layout.time, "time_ns", lambda: 1)
        assert _commit(o, "p", 1, [1]) is True
        monkeypatch.undo()
        assert o.committed()["p"]["attempt"] == 1
        assert open_output(o.root, job_digest="d1").committed()["p"]["attempt"] == 1
    finally:
        storage.configure(None)


def test_finish_consolidates_and_refuses_zombies(out):
    for i in range(5):
        assert _commit(out, f"b03-s{i:04d}", 1, [10 * i, 10 * i + 1])
    late = out.start_attempt("b03-s0009", 1)
    empty_errors = pa.table({"id": pa.array([], pa.int64()), "error_code": pa.array([], pa.string())})
    out.finish({"generated_rows": 10}, out.committed(), {"errors": empty_errors})
    files = objects(out.root)
    assert not any(f.startswith(("_attempts/", "_manifest/")) for f in files)
    assert [f for f in files if f.startswith("generations/")] == ["generations/part-00000.parquet"]
    assert [f for f in files if f.startswith("errors/")] == ["errors/part-00000.parquet"]
    success = json.loads(storage.read_bytes(f"{out.root}/_SUCCESS"))
    assert success["files"]["generations"] == ["generations/part-00000.parquet"]
    assert sorted(read_output(out.root).to_table().column("id").to_pylist()) == sorted(
        [10 * i + j for i in range(5) for j in range(2)])
    assert read_output(out.root, "errors").to_table().num_rows == 0
    assert set(out.committed()) == {f"b03-s{i:04d}" for i in range(5)}  # from _SUCCESS, not a listing
    with pytest.raises(ZombieAttemptError):
        out.start_attempt("b03-s0009", 2)
    # an attempt that started before the finish and commits after it leaves nothing
    assert out.commit("b03-s0009", 1, _tables([99]), {"rows": 1}, late) is False
    assert not any(f.startswith(("_attempts/", "_manifest/")) for f in objects(out.root))


def test_consolidation_rolls_files_at_the_target_size(out, monkeypatch):
    monkeypatch.setattr(consolidate, "TARGET_FILE_BYTES", 1)
    for i in range(3):
        assert _commit(out, f"b04-s{i:04d}", 1, [i])
    out.finish({}, out.committed(), {})
    assert len([f for f in objects(out.root) if f.startswith("generations/")]) == 3
    assert sorted(read_output(out.root).to_table().column("id").to_pylist()) == [0, 1, 2]


def test_lease_keeps_a_second_driver_out(out):
    first = open_output(out.root)
    first.lock()
    try:
        second = open_output(out.root)
        with pytest.raises(LockHeldError, match="another run"):
            second.lock()
    finally:
        first.unlock()
    second.lock()  # released: free again
    second.unlock()


def test_lease_of_a_dead_process_on_this_host_is_taken_over(out):
    first = open_output(out.root)
    first.lock()
    first._lease._stop.set()  # a driver SIGKILLed: no renewal, no release — and its pid is gone
    record = json.loads(storage.read_bytes(f"{out.root}/_lease.json"))
    record["pid"] = 2**22 + 12345  # no such process
    fs, path = storage.filesystem(f"{out.root}/_lease.json")
    with fs.open_output_stream(path) as fh:
        fh.write(json.dumps(record).encode())
    second = open_output(out.root)
    second.lock()
    second.unlock()
    record["host"], record["pid"], record["expires_at"] = "elsewhere", os.getpid(), 0
    with fs.open_output_stream(path) as fh:  # another host's lease, expired
        fh.write(json.dumps(record).encode())
    second.lock()
    second.unlock()


def test_secrets_are_never_shown():
    s = storage.StorageSettings(access_key_id="AKIA", secret_access_key="hunter2", session_token="tok")
    assert "hunter2" not in repr(s) and "tok'" not in repr(s)
    assert s.masked()["secret_access_key"] == "***" and s.masked()["access_key_id"] == "AKIA"
    assert dataclasses.replace(s, secret_access_key=None).masked()["secret_access_key"] is None


def test_a_manifest_that_can_never_count_does_not_block_its_piece(out):
    """A late attempt of a replaced job took the piece's manifest name first; this job still commits."""
    other = open_output(out.root, job_digest="d0")
    assert _commit(other, "b05-s0000", 1, [1])
    assert "b05-s0000" not in out.committed()
    assert _commit(out, "b05-s0000", 2, [1]) is True
    assert out.committed()["b05-s0000"]["attempt"] == 2
    out.clean_orphans(out.committed())  # the driver removes what can never count
    left = [f for f in objects(out.root) if f.startswith("_manifest/b05-s0000")]
    assert left and all(json.loads(storage.read_bytes(f"{out.root}/{f}"))["job_digest"] == "d1" for f in left)
    assert out.committed()["b05-s0000"]["attempt"] == 2


def test_pieces_with_different_columns_consolidate_into_one_schema(out):
    first = {"generations": pa.table({"id": pa.array([1], pa.int64()), "note": pa.array([None], pa.null())})}
    second = {"generations": pa.table({"id": pa.array([2], pa.int64()), "note": ["x"], "extra": [1.5]})}
    assert out.commit("b06-s0000", 1, first, {"rows": 1})
    assert out.commit("b06-s0001", 1, second, {"rows": 1})
    out.finish({}, out.committed(), {})
    table = read_output(out.root).to_table().sort_by("id")
    assert table.to_pylist() == [{"id": 1, "note": None, "extra": None}, {"id": 2, "note": "x", "extra": 1.5}]


def test_a_run_that_lost_its_lease_does_not_finish(out):
    out.lock()
    try:
        assert _commit(out, "b07-s0000", 1, [1])
        out._lease.lost = "elsewhere pid 1 took the lease"
        with pytest.raises(LockHeldError, match="lost its lease"):
            out.finish({}, out.committed(), {})
        assert not any(f == "_SUCCESS" for f in objects(out.root))
    finally:
        out.unlock()
