"""The in-process executor (`executor.kind=local`); `ExecResult` (what every executor returns) is re-exported.

Who calls it: `runner.job.run` picks `run_local` or `runner.ray_executor.RayExecutor.run`; both take
the pending shards in dispatch order (longest buckets first), honour the stop flag between shards,
retry a failing shard up to `executor.max_attempts`, and report progress.
"""

from __future__ import annotations

import logging

from flashx_batch.config import JobConfig
from flashx_batch.data.plan import ShardSpec
from flashx_batch.runner.executor_result import ExecResult
from flashx_batch.runner.failures import FATAL, FailedRows, WorkerFailure
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.retries import Retries
from flashx_batch.runner.signals import StopFlag
from flashx_batch.runner.worker import ShardWorker, WorkerContext

log = logging.getLogger(__name__)


def run_local(job: JobConfig, ctx: WorkerContext, shards: list[ShardSpec], stop: StopFlag,
              progress: Progress, failed_rows: FailedRows | None = None) -> ExecResult:
    """Run every shard in this process, one after another, with one engine.

    Failures follow the shared retry state machine (`runner.retries`); a fatal engine error builds a new
    worker (a new engine) before the retry. There is no process to kill here: a worker crash is the
    driver's crash (a rerun resumes) and a hang is not cut short — the watchdog and poison-row isolation
    need `executor.kind=ray` (docs/reliability.md).
    """
    result = ExecResult()
    if not shards:
        return result
    workers = [ShardWorker(job, ctx, name="local")]  # the last one is in use; a fatal error appends another
    try:
        return _run_all(job, ctx, workers, Retries(shards, job.executor.max_attempts, result, progress, failed_rows),
                        stop)
    finally:
        for w in workers:  # a tensor-parallel engine's other ranks end with it
            w.close()


def _run_all(job: JobConfig, ctx: WorkerContext, workers: list[ShardWorker], retries: Retries,
             stop: StopFlag) -> ExecResult:
    worker, result = workers[-1], retries.result
    retries.progress.restart_clock()
    while retries.queue:
        if stop.requested:
            result.interrupted = True
            break
        work = retries.queue.popleft()
        summary = worker.run_shard(work.spec, work.attempt)
        if "failure" not in summary:
            retries.succeeded(work, summary, summary.get("wall_s"))
            continue
        failure = WorkerFailure.from_dict(summary["failure"])  # retried, then reported, never swallowed
        if retries.failed(work, failure).abort:
            break
        if failure.kind == FATAL:
            worker.close()
            worker = ShardWorker(job, ctx, name=f"local-{work.spec.shard_id}-{work.attempt}")
            workers.append(worker)
    return result
