"""Crash safety: a driver SIGKILLed at random points and resumed loses and duplicates nothing;
a crash between publish and manifest, a zombie second attempt, a disk that fills; SIGTERM drains
within the grace period (143), a second signal stops at once; every case resumes to completion."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from batch_support import (
    assert_finished_layout,
    cli,
    faults_override,
    output_ids,
    overrides,
    sample_rows,
    tiny_model_dir,
    write_parquet,
)

from flashx_batch.config import compose_job
from flashx_batch.runner import faults, run
from flashx_batch.runner.job import plan_job
from flashx_batch.runner.worker import ShardWorker, WorkerContext

N_ROWS = 36
# Small shards and fixed-length generations: many commits, each tens to hundreds of ms depending on the
# machine, so a kill can land in the middle of a shard, between a rename and its manifest, or between shards.
SLOW = ("runtime.shard_size=2", "runtime.max_batch_size=2", "runtime.max_output_len=24", "sampling.max_new_tokens=24",
        "sampling.ignore_eos=true")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = sample_rows(N_ROWS, seed=3)
    rows[4]["prompt"] = None  # an error shard too, committed by the driver
    return write_parquet(tmp_path_factory.mktemp("in") / "in.parquet", rows)


@pytest.fixture(scope="module")
def job_args(data):
    return lambda out, *extra: overrides(tiny_model_dir(), data, out, *SLOW, *extra)


@pytest.fixture(scope="module")
def shards(job_args, tmp_path_factory):
    """The plan's generate shards (dispatch order) and each one's ids."""
    plan = plan_job(compose_job(job_args(tmp_path_factory.mktemp("plan") / "out"))).plan
    return [(s, [plan.ref_ids[r] for r in s.refs]) for s in plan.shards]


def _manifests(out: Path) -> int:
    d = out / "_manifest"
    return len(list(d.glob("*.json"))) if d.is_dir() else 0


def _kill_at(proc, out: Path, commits: int, in_flight: bool, timeout: float = 120) -> bool:
    """SIGKILL `proc` at an event: once `commits` manifests exist, or (`in_flight`) once a shard beyond them
    has started (its attempt directory exists) — never after a delay, so where it dies does not depend on the
    machine's speed. False if it finished first."""
    deadline = time.monotonic() + timeout

    def reached() -> bool:
        return _manifests(out) >= commits and (not in_flight or any((out / "_attempts").glob("*")))

    while not reached() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        return False
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return True


def _assert_exactly_once(out: Path) -> None:
    generated, errors = output_ids(out)
    both = generated + errors
    assert [i for i, n in both.items() if n > 1] == [], "duplicated ids"
    assert sorted(both) == list(range(N_ROWS)), "missing ids"
    assert set(errors) == {4}
    acc = json.loads((out / "job.json").read_text())["accounting"]
    assert (acc["input_rows"], acc["generated_rows"], acc["error_rows"], acc["pending_rows"]) == (N_ROWS, N_ROWS - 1,
                                                                                                 1, 0)
    assert_finished_layout(out)  # no orphan: every file in place is committed
    assert not (out / "_attempts").exists()


def test_sigkill_at_random_points_then_resume(job_args, tmp_path):
    seed = 20261205  # fixed: the kill points are the same on every run
    rng = random.Random(seed)
    out = tmp_path / "out"
    kills = 0
    for _ in range(8):  # at least 5 kills land before the job can finish on its own
        # 1-2 more commits in this run, then die right at the commit or once the next shard is under way
        target = _manifests(out) + rng.randint(1, 2)
        proc = cli(job_args(out), cwd=tmp_path, background=True)
        if _kill_at(proc, out, target, in_flight=rng.random() < 0.5):
            kills += 1
        if kills >= 5:
            break
    assert kills >= 5, f"seed={seed}: the job finished before 5 kills"
    final = cli(job_args(out), cwd=tmp_path)
    assert final.returncode == 0, f"seed={seed}\n{final.stderr[-3000:]}"
    _assert_exactly_once(out)
    assert not (out / "_attempts").exists(), "attempt directories left behind"
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "succeeded" and len(record["runs"]) == kills + 1
    assert [r["resumed_shards"] for r in record["runs"]] == sorted(r["resumed_shards"] for r in record["runs"])


def test_sigterm_stops_with_143_and_resumes(job_args, tmp_path):
    out = tmp_path / "out"
    proc = cli(job_args(out), cwd=tmp_path, background=True)
    deadline = time.monotonic() + 120
    while _manifests(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, log[-3000:]
    assert not any((out / "_attempts").glob("*"))  # drained: the in-flight shard committed, none abandoned
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "interrupted"
    assert not (out / "_SUCCESS").exists()
    assert _manifests(out) < N_ROWS // 2 + 1  # it stopped early, not after doing everything
    resumed = cli(job_args(out), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "already committed" in resumed.stderr
    _assert_exactly_once(out)


def test_crash_between_publish_and_manifest_then_resume(job_args, shards, tmp_path):
    out, victim = tmp_path / "out", shards[2][0].shard_id
    crashed = cli(job_args(out, faults_override([f"crash:at=after_publish:shard={victim}"])), cwd=tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    # what the crash left: part of the shard published, no manifest — not committed
    assert (out / "generations" / f"part-{victim}.parquet").is_file()
    assert not (out / "_manifest" / f"{victim}.json").exists()
    resumed = cli(job_args(out), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_exactly_once(out)


def _wait_for(cond, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_second_signal_stops_at_once_and_grace_expiry_stops_too(job_args, shards, tmp_path):
    hung, row = shards[1][0].shard_id, shards[1][1][0]  # the second shard never finishes
    hang = faults_override([f"hang:row={row}"])
    out = tmp_path / "out"
    proc = cli(job_args(out, hang, "executor.grace_period_s=60"), cwd=tmp_path, background=True)
    _wait_for(lambda: list((out / "_attempts").glob(f"{hung}.*")) or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    assert proc.poll() is None  # draining: waits for the in-flight shard, up to 60 s
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=50)  # well inside the 60 s grace: the second signal did not wait for it
    assert proc.returncode == 143
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "interrupted" and record["accounting"]["pending_rows"] > 0
    # the same hang, one signal, a 2 s grace period: the drain gives up on the shard and exits 143
    stale = set((out / "_attempts").glob(f"{hung}.*"))  # the forced exit left its attempt dir behind
    proc = cli(job_args(out, hang, "executor.grace_period_s=2"), cwd=tmp_path, background=True)
    _wait_for(lambda: set((out / "_attempts").glob(f"{hung}.*")) - stale or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    proc.communicate(timeout=120)  # the shard hangs for ever: only the grace period's expiry ends the run
    # a lower bound only (a slow machine makes it later, never earlier): it honoured the 2 s grace period
    assert proc.returncode == 143 and time.monotonic() - sent > 1.5
    resumed = cli(job_args(out), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_exactly_once(out)


def test_disk_full_leaves_no_partial_file_and_a_rerun_succeeds(job_args, shards, tmp_path):
    out, victim = tmp_path / "out", shards[0][0].shard_id
    assert run(compose_job(job_args(out, faults_override([f"enospc:kind=generations:shard={victim}"])))) == 1
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "failed" and victim in record["failed_shards"]
    assert not (out / "generations" / f"part-{victim}.parquet").exists()
    assert not list((out / "_attempts").glob(f"{victim}.*"))  # each failed try removed its torn files
    assert record["accounting"]["pending_rows"] == len(shards[0][1])
    assert run(compose_job(job_args(out))) == 0
    _assert_exactly_once(out)


class _ZombieFirst:
    """Fault hook: after the job's own attempt of `shard` generated, a second attempt runs and
    commits first — the first attempt is now the zombie, and it must lose."""

    def __init__(self, shard, zombie: ShardWorker) -> None:
        self.shard, self.zombie, self.zombie_summary = shard, zombie, None

    def fire(self, point, shard, attempt, ids=None, kind=None, peers=()):
        if point == "after_generate" and shard == self.shard.shard_id and attempt == 1:
            self.zombie_summary = self.zombie.run_shard(self.shard, 2)


def test_zombie_second_attempt_of_the_same_shard(job_args, shards, tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    out, spec = tmp_path / "out", shards[1][0]
    job = compose_job(job_args(out))
    planned = plan_job(job)
    model_dir, loaded = planned.model_dir, planned.loaded
    zombie = ShardWorker(job, WorkerContext(str(model_dir), str(out), loaded.files, loaded.id_kind))
    hook = _ZombieFirst(spec, zombie)
    monkeypatch.setattr(faults, "load", lambda *a, **k: hook)
    assert run(job) == 0
    assert hook.zombie_summary["committed"] is True
    _assert_exactly_once(out)
    stats = [r for r in pq.read_table(out / "stats").to_pylist() if r["shard_id"] == spec.shard_id]
    assert [r["attempt"] for r in stats] == [2]  # the late first attempt left nothing behind
    # and a zombie outliving the finished job is refused before it writes anything
    refused = zombie.run_shard(spec, 3)["failure"]
    assert refused["type"] == "ZombieAttemptError" and "zombie" in refused["message"]
    _assert_exactly_once(out)


def test_samples_and_per_row_sampling_survive_kills_exactly_once(tmp_path):
    """sampling.n=3 with logprobs and per-row temperature / max_new_tokens / seed columns: killed mid-job
    and resumed, every (id, sample) is committed once, equal to an uninterrupted run; a bad per-row
    value is an error row; a resume with other per-row settings is refused."""
    import pyarrow.parquet as pq

    rows = sample_rows(10, seed=5)
    for r in rows:
        r.update(temp=0.8 + (r["id"] % 3) * 0.3, budget=5 + r["id"] % 4, seed=1000 + r["id"])
    rows[3]["temp"] = None  # a null cell: the job-wide temperature
    rows[6]["temp"] = -1.0  # a bad value: an error row, the rest of the job runs
    data = write_parquet(tmp_path / "in" / "in.parquet", rows)
    columns = "+sampling.from_columns={temperature:temp,max_new_tokens:budget,seed:seed}"
    common = ("runtime.shard_size=2", "runtime.max_batch_size=2", "runtime.max_output_len=24",
              "sampling.ignore_eos=true", "sampling.temperature=1.0", "sampling.n=3", "sampling.logprobs=2")

    def args(out, per_row=columns):
        return overrides(tiny_model_dir(), data, out, *common, per_row)

    out, kills = tmp_path / "out", 0
    for attempt in range(5):
        proc = cli(args(out), cwd=tmp_path, background=True)
        if _kill_at(proc, out, _manifests(out) + 1, in_flight=attempt % 2 == 1):
            kills += 1
        if kills >= 2:
            break
    assert kills >= 1, "the job finished before any kill"
    final = cli(args(out), cwd=tmp_path)
    assert final.returncode == 0, final.stderr[-3000:]
    assert run(compose_job(args(tmp_path / "clean"))) == 0

    def table(root):
        return sorted(pq.read_table(root / "generations").to_pylist(), key=lambda r: (r["id"], r["sample_index"]))

    got, clean = table(out), table(tmp_path / "clean")
    pairs = [(r["id"], r["sample_index"]) for r in got]
    assert pairs == [(i, s) for i in range(10) if i != 6 for s in range(3)]  # each (id, sample) once
    errors = pq.read_table(out / "errors").to_pylist()
    assert [(e["id"], e["error_code"]) for e in errors] == [(6, "bad_sampling_param")]
    assert "temperature" in errors[0]["error_message"]
    for a, b in zip(got, clean, strict=True):
        assert (a["token_ids"], a["generated_text"]) == (b["token_ids"], b["generated_text"])
        assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-5)
        assert a["num_generated_tokens"] == rows[a["id"]]["budget"] == len(a["token_logprobs"])
        assert all(len(step) == 2 and step[0]["logprob"] >= step[1]["logprob"] for step in a["top_logprobs"])
    distinct = [len({tuple(r["token_ids"]) for r in got if r["id"] == i}) for i in range(10) if i != 6]
    assert sum(d > 1 for d in distinct) >= len(distinct) // 2  # seeded per (row, sample): samples differ
    acc = json.loads((out / "job.json").read_text())["accounting"]
    assert (acc["generated_rows"], acc["error_rows"], acc["pending_rows"]) == (9, 1, 0)
    refused = cli(args(out, "+sampling.from_columns={temperature:temp,max_new_tokens:budget}"), cwd=tmp_path)
    assert refused.returncode == 2 and "sampling.from_columns" in refused.stderr
