"""Crash safety: a driver SIGKILLed at random points and resumed loses and duplicates nothing;
SIGTERM stops cleanly with 143 and a resumable job."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from batch_support import cli, output_ids, overrides, sample_rows, tiny_model_dir, write_parquet

N_ROWS = 36
# Small shards and fixed-length generations: many commits, each a few hundred ms, so a kill can land
# in the middle of a shard, between a rename and its manifest, or between shards.
SLOW = ("runtime.shard_size=2", "runtime.max_batch_size=2", "sampling.max_new_tokens=12",
        "sampling.ignore_eos=true")


@pytest.fixture(scope="module")
def job_args(tmp_path_factory):
    rows = sample_rows(N_ROWS, seed=3)
    rows[4]["prompt"] = None  # an error shard too, committed by the driver
    data = write_parquet(tmp_path_factory.mktemp("in") / "in.parquet", rows)
    return lambda out: overrides(tiny_model_dir(), data, out, *SLOW)


def _manifests(out: Path) -> int:
    d = out / "_manifest"
    return len(list(d.glob("*.json"))) if d.is_dir() else 0


def _kill_after(proc, out: Path, commits: int, jitter_s: float, timeout: float = 120) -> bool:
    """SIGKILL `proc` once `commits` manifests exist (+ jitter); False if it finished first."""
    deadline = time.monotonic() + timeout
    while _manifests(out) < commits and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(jitter_s)
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


def test_sigkill_at_random_points_then_resume(job_args, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    out = tmp_path / "out"
    kills = 0
    for _ in range(6):  # at least 3 kills land before the job can finish on its own
        target = _manifests(out) + rng.randint(1, 3)  # 1-3 more commits in this run, then a random delay
        proc = cli(job_args(out), cwd=tmp_path, background=True)
        if _kill_after(proc, out, target, rng.uniform(0.0, 0.25)):
            kills += 1
        if kills >= 3:
            break
    assert kills >= 3, f"seed={seed}: the job finished before 3 kills"
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
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, log[-3000:]
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "interrupted"
    assert not (out / "_SUCCESS").exists()
    assert _manifests(out) < N_ROWS // 2 + 1  # it stopped early, not after doing everything
    resumed = cli(job_args(out), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "already committed" in resumed.stderr
    _assert_exactly_once(out)
