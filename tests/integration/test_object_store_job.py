"""Jobs with input and output on an S3-compatible server (moto, started here on 127.0.0.1): the
default job, a worker killed mid-shard, a driver SIGKILLed and resumed, a zombie attempt — each
ending with every input id exactly once, read back through `flashx_batch.read_output`, and a
finished layout of a few consolidated files per kind (runner/object_layout.py)."""

from __future__ import annotations

import os
import signal
import time

import pyarrow.parquet as pq
import pytest
from batch_support import cli, faults_override, overrides, sample_rows, tiny_model_dir, write_parquet
from s3_support import job_record, make_bucket, objects, output_ids, s3_server, upload

from flashx_batch import read_output, storage
from flashx_batch.config import compose_job, resolve_data_path
from flashx_batch.errors import ConfigError
from flashx_batch.runner import faults, object_lease, run
from flashx_batch.runner.job import plan_job
from flashx_batch.runner.worker import ShardWorker, WorkerContext

N_ROWS = 30
SLOW = ("runtime.shard_size=2", "runtime.max_batch_size=2", "runtime.max_output_len=24", "sampling.max_new_tokens=24",
        "sampling.ignore_eos=true")


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    with s3_server():
        uri = make_bucket("jobs")
        rows = sample_rows(N_ROWS, seed=5)
        rows[3]["prompt"] = None  # an error row, committed by the driver
        local = write_parquet(tmp_path_factory.mktemp("in") / "in.parquet", rows)
        upload(local, f"{uri}/in/part-0.parquet")
        yield uri


@pytest.fixture(autouse=True)
def quick_lease(monkeypatch):
    monkeypatch.setattr(object_lease, "_SETTLE_S", 0.1)


def _args(bucket: str, out: str, *extra: str) -> list[str]:
    return overrides(tiny_model_dir(), f"{bucket}/in/", None, f"output.dir={out}", *extra)


def _assert_exactly_once(out: str, ids: list | None = None, error_ids: frozenset = frozenset({3})) -> None:
    ids = list(range(N_ROWS)) if ids is None else ids
    n_rows = len(ids)
    generated, errors = output_ids(out)
    both = generated + errors
    assert [i for i, n in both.items() if n > 1] == [], "duplicated ids"
    assert sorted(both) == sorted(ids), "missing ids"
    assert set(errors) == set(error_ids)
    record = job_record(out)
    acc = record["accounting"]
    assert (acc["input_rows"], acc["generated_rows"], acc["error_rows"], acc["pending_rows"]) == (
        n_rows, n_rows - len(error_ids), len(error_ids), 0)
    files = objects(out)
    assert not any(f.startswith(("_attempts/", "_manifest/", "_lease")) for f in files), files
    for kind in ("generations", "errors", "stats"):  # one valid dataset per kind, a few files
        mine = [f for f in files if f.startswith(kind + "/")]
        assert 1 <= len(mine) <= 2, (kind, mine)
    assert "_SUCCESS" in files and "report.md" in files


def test_default_job_with_input_and_output_on_s3(bucket, tmp_path):
    """The embedded default (conf=legal_docs: the bundled model and sample) read from and written to S3."""
    upload(resolve_data_path("bundled://legal_docs.parquet"), f"{bucket}/legal/legal_docs.parquet")
    out = f"{bucket}/legal-out"
    args = ["conf=legal_docs", f"data.path={bucket}/legal/legal_docs.parquet", f"output.dir={out}", "data.limit=16",
            "sampling.max_new_tokens=8", "executor.num_actors=2", "executor.progress_interval_s=1000",
            "storage.access_key_id=testing", "storage.secret_access_key=testing"]
    done = cli(args, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    # the same job into a local directory: the same rows, the same texts, the same error rows
    local = tmp_path / "local-out"
    assert cli([*args[:2], f"output.dir={local}", *args[3:]], cwd=tmp_path, timeout=400).returncode == 0
    expected = {r["id"]: r["generated_text"] for r in read_output(local).to_table().to_pylist()}
    errors = set(read_output(local, "errors").to_table().column("id").to_pylist())
    _assert_exactly_once(out, [*expected, *errors], frozenset(errors))
    assert {r["id"]: r["generated_text"] for r in read_output(out).to_table().to_pylist()} == expected
    record = job_record(out)
    assert record["config"]["storage"]["secret_access_key"] == "***"
    assert "testing" not in done.stderr.replace("storage.access_key_id=testing", "")
    rerun = cli(args, cwd=tmp_path, timeout=400)
    assert rerun.returncode == 0 and "already done" in rerun.stderr, rerun.stderr[-2000:]


def test_worker_killed_mid_shard_on_s3(bucket, tmp_path):
    """Ray actors SIGKILLed mid-shard and between writing parts and the manifest."""
    out = f"{bucket}/killed"
    plan = plan_job(compose_job(_args(bucket, out, *SLOW))).plan
    a, b = plan.shards[1].shard_id, plan.shards[4].shard_id
    specs = [f"crash:at=after_generate:attempt=1:shard={a}", f"crash:at=before_manifest:attempt=1:shard={b}"]
    done = cli(_args(bucket, out, *SLOW, "executor.kind=ray", "executor.num_actors=2", faults_override(specs)),
               cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_exactly_once(out)
    stats = read_stats(out)
    assert {r["shard_id"]: r["attempt"] for r in stats}[a] == 2 and {r["shard_id"]: r["attempt"] for r in stats}[b] == 2


def read_stats(out: str) -> list[dict]:
    return read_output(out, "stats").to_table().to_pylist()


def _manifests(out: str) -> int:
    return sum(f.startswith("_manifest/") for f in objects(out))


def test_driver_sigkill_then_resume_on_s3(bucket, tmp_path):
    out = f"{bucket}/sigkill"
    kills = 0
    for target in (2, 5, 9):
        proc = cli(_args(bucket, out, *SLOW), cwd=tmp_path, background=True)
        deadline = time.monotonic() + 120
        while _manifests(out) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
    assert kills >= 2, "the job finished before it could be killed twice"
    assert not objects(out).count("_SUCCESS")
    final = cli(_args(bucket, out, *SLOW), cwd=tmp_path)  # the lease of the dead driver is taken over at once
    assert final.returncode == 0, final.stderr[-3000:]
    assert "already committed" in final.stderr
    _assert_exactly_once(out)
    assert len(job_record(out)["runs"]) == kills + 1


class _ZombieFirst:
    """After the job's own attempt of `shard` generated, a second attempt runs and commits first:
    the first attempt is now the zombie, and it must lose."""

    def __init__(self, shard, zombie: ShardWorker) -> None:
        self.shard, self.zombie, self.zombie_summary = shard, zombie, None

    def fire(self, point, shard, attempt, ids=None, kind=None, peers=()):
        if point == "after_generate" and shard == self.shard.shard_id and attempt == 1:
            self.zombie_summary = self.zombie.run_shard(self.shard, 2)


@pytest.mark.parametrize("conditional", [True, False], ids=["conditional_put", "tie_break"])
def test_zombie_attempt_on_s3(bucket, conditional, monkeypatch):
    out = f"{bucket}/zombie-{conditional}"
    job = compose_job(_args(bucket, out, *SLOW, f"storage.conditional_put={str(conditional).lower()}"))
    planned = plan_job(job)
    model_dir, loaded, plan = planned.model_dir, planned.loaded, planned.plan
    spec = plan.shards[1]
    zombie = ShardWorker(job, WorkerContext(str(model_dir), out, loaded.files, loaded.id_kind))
    hook = _ZombieFirst(spec, zombie)
    monkeypatch.setattr(faults, "load", lambda *a, **k: hook)
    assert run(job) == 0
    assert hook.zombie_summary["committed"] is True
    _assert_exactly_once(out)
    attempts = [r["attempt"] for r in read_stats(out) if r["shard_id"] == spec.shard_id]
    assert attempts == [2]  # the late first attempt counts nowhere
    refused = zombie.run_shard(spec, 3)["failure"]  # a zombie outliving the finished job
    assert refused["type"] == "ZombieAttemptError"
    _assert_exactly_once(out)
    storage.configure(None)


def test_read_output_reads_a_local_job_too(tmp_path):
    data = write_parquet(tmp_path / "in.parquet", sample_rows(6, seed=1))
    out = tmp_path / "out"
    assert run(compose_job(overrides(tiny_model_dir(), data, out))) == 0
    ids = sorted(read_output(out).to_table().column("id").to_pylist())
    assert ids == list(range(6)) == sorted(pq.read_table(out / "generations").column("id").to_pylist())


def test_a_job_on_an_fsspec_filesystem_uses_the_tie_break(tmp_path):
    """A scheme pyarrow has no filesystem for goes through fsspec (here its in-process memory://):
    no conditional put there, so commits resolve by the tie-break; two runs of the same job into
    one prefix (the second resumes nothing, it is already done) and every id once."""
    import fsspec

    mem = fsspec.filesystem("memory")
    local = write_parquet(tmp_path / "in.parquet", sample_rows(10, seed=2))
    with mem.open("fx-mem/in/rows.parquet", "wb") as fh:
        fh.write(local.read_bytes())
    out = "memory://fx-mem/out"
    job = compose_job(overrides(tiny_model_dir(), "memory://fx-mem/in/*.parquet", None, f"output.dir={out}"))
    try:
        assert run(job) == 0
        ids = sorted(read_output(out).to_table().column("id").to_pylist())
        assert ids == list(range(10))
        assert [f for f in objects(out) if f.startswith("generations/")] == ["generations/part-00000.parquet"]
        assert run(job) == 0  # already done
        assert sorted(read_output(out).to_table().column("id").to_pylist()) == list(range(10))
    finally:
        mem.rm("fx-mem", recursive=True)
        storage.configure(None)


def test_object_store_paths_in_any_spelling_name_one_output(bucket):
    """`s3://b//x` once ended in a double traceback (exit 1) and `s3://b/./x` in exit 75 on every try (a
    lease written under `./x/_lease.json`, read back as `x/_lease.json`): every spelling is the one
    normalised URI, and a path above the bucket is refused before anything is written (exit 2)."""
    for spelling in (f"{bucket}//spelled", f"{bucket}/./spelled", f"{bucket}/spelled/sub/../"):
        assert run(compose_job(_args(bucket, spelling, "executor.kind=local"))) == 0, spelling
    assert not [o for o in objects(bucket) if o.startswith((".", "/")) or "/./" in o or "//" in o]
    _assert_exactly_once(f"{bucket}/spelled")
    with pytest.raises(ConfigError, match="climbs above the root"):  # the command line: exit 2
        compose_job(_args(bucket, f"{bucket}/../elsewhere", "executor.kind=local"))
