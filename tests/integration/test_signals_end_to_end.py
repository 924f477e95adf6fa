"""What docs/reliability.md promises about signals and retries, shown on whole runs of the real CLI.

- Under Ray (the default preset's executor), one job through SIGINT (exit 130), a driver SIGKILL, and
  SIGTERM (exit 143, the in-flight shard drained), each sent at an event (a number of committed shards),
  then resumed to the end: every id exactly once, each run recorded.
- The local executor's fatal-error path that succeeds: a dead engine on a shard's first try, the engine
  rebuilt and the shard retried, exit 0 with every id once.
- SIGTERM while the driver verifies the output: it stops before `_SUCCESS` (exit 143, `interrupted`, every
  row accounted for), and the rerun only finishes.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from batch_support import cli, faults_override, output_ids, overrides, sample_rows, tiny_model_dir, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.runner import run

pytestmark = pytest.mark.slow

N_ROWS = 24
SMALL_SHARDS = ("runtime.shard_size=2", "runtime.max_batch_size=2", "runtime.max_output_len=24",
                "sampling.max_new_tokens=24", "sampling.ignore_eos=true")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("in") / "in.parquet", sample_rows(N_ROWS, seed=11))


def _manifests(out: Path) -> int:
    return len(list((out / "_manifest").glob("*.json"))) if (out / "_manifest").is_dir() else 0


def _when(proc, cond, timeout: float = 180) -> bool:
    """Wait for `cond()` while `proc` runs (a watchdog bound, not a speed claim); False if it ended first."""
    deadline = time.monotonic() + timeout
    while not cond() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.poll() is None


def _exactly_once(out: Path) -> None:
    generated, errors = output_ids(out)
    both = generated + errors
    assert [i for i, n in both.items() if n > 1] == [] and len(both) == N_ROWS


def test_sigint_driver_sigkill_and_sigterm_under_ray_then_resume_exactly_once(data, tmp_path):
    out = tmp_path / "out"
    args = [*overrides(tiny_model_dir(), data, out, *SMALL_SHARDS), "executor.kind=ray", "executor.num_actors=1"]
    # SIGINT after 2 committed shards: the drain, exit 130
    proc = cli(args, cwd=tmp_path, background=True)
    assert _when(proc, lambda: _manifests(out) >= 2), "finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    log = proc.communicate(timeout=180)[0]
    assert proc.returncode == 130, log[-3000:]
    assert json.loads((out / "job.json").read_text())["status"] == "interrupted"
    # the driver SIGKILLed two commits later: nothing can be recorded, the resume finds it
    committed = _manifests(out)
    proc = cli(args, cwd=tmp_path, background=True)
    assert _when(proc, lambda: _manifests(out) >= committed + 2), "finished before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # SIGTERM two commits later: the in-flight shard drains, exit 143
    committed = _manifests(out)
    proc = cli(args, cwd=tmp_path, background=True)
    assert _when(proc, lambda: _manifests(out) >= committed + 2), "finished before the SIGTERM"
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=180)[0]
    assert proc.returncode == 143, log[-3000:]
    assert not any((out / "_attempts").glob("*"))  # drained: nothing in flight abandoned
    assert _manifests(out) < N_ROWS // 2  # it stopped early
    final = cli(args, cwd=tmp_path, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    _exactly_once(out)
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "succeeded" and len(record["runs"]) == 4


def test_a_fatal_engine_error_on_the_local_executor_rebuilds_the_engine_and_succeeds(data, tmp_path):
    out = tmp_path / "out"
    job = compose_job(overrides(tiny_model_dir(), data, out, *SMALL_SHARDS, "executor.max_attempts=2",
                                faults_override(["fatal:attempt=1:shard=*-0001-*"])))
    assert run(job) == 0
    _exactly_once(out)
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "succeeded"
    failures = record["worker_failures"]  # the tries that died, recorded: one per matching shard's first try
    assert len(failures) == 4 and all(f["attempt"] == 1 and "-0001-" in f["shard_id"] for f in failures), failures
    assert all("fatal" in json.dumps(f).lower() for f in failures)


def test_sigterm_while_verifying_stops_before_success_and_the_rerun_only_finishes(data, tmp_path, monkeypatch):
    """docs/reliability.md: SIGTERM while verifying stops before `_SUCCESS` (exit 143, `interrupted` with full
    accounting); the rerun only finishes."""
    import os

    from flashx_batch.runner import job_run

    out = tmp_path / "out"
    real = job_run.verify_output
    sent = []

    def verify_then_signal(*a, **kw):  # the event: the driver has started verifying
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    monkeypatch.setattr(job_run, "verify_output", verify_then_signal)
    args = overrides(tiny_model_dir(), data, out, *SMALL_SHARDS)
    assert run(compose_job(args)) == 143 and sent
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "interrupted" and not (out / "_SUCCESS").exists()
    assert record["accounting"]["pending_rows"] == 0  # every row was done: only the verdict is missing
    _exactly_once(out)
    monkeypatch.setattr(job_run, "verify_output", real)
    assert run(compose_job(args)) == 0
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "succeeded" and (out / "_SUCCESS").exists()
    assert record["runs"][-1].get("resumed_shards", 0) > 0  # nothing generated again
    _exactly_once(out)
