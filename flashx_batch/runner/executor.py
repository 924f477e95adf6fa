"""What every executor returns, and the in-process (`executor.kind=local`) executor.

Who calls it: `runner.job.run` picks `run_local` or `runner.ray_executor.RayExecutor.run`; both take
the pending shards in dispatch order (longest buckets first), honour the stop flag between shards,
retry a failing shard up to `executor.max_attempts`, and report progress.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from flashx_batch.config import JobConfig
from flashx_batch.data.plan import ShardSpec
from flashx_batch.runner.failures import FATAL, Work, WorkerFailure, decide
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.signals import StopFlag
from flashx_batch.runner.worker import ShardWorker, WorkerContext

log = logging.getLogger(__name__)


@dataclass
class ExecResult:
    done: list[str] = field(default_factory=list)  # shard ids committed by this run
    failed: dict[str, str] = field(default_factory=dict)  # piece id -> last error, after max_attempts
    failures: list[WorkerFailure] = field(default_factory=list)  # every failed try, in order (job.json)
    aborted: WorkerFailure | None = None  # a failure that makes the whole job impossible (exit 2)
    interrupted: bool = False
    nodes: dict[str, dict] = field(default_factory=dict)  # Ray: per node, placements, commits, failures, exclusion

    def record(self, failure: WorkerFailure) -> None:
        """Log a failed try in one readable block and keep it (the last few go to job.json)."""
        log.warning("%s", failure.block())
        self.failures.append(failure)


def run_local(job: JobConfig, ctx: WorkerContext, shards: list[ShardSpec], stop: StopFlag,
              progress: Progress) -> ExecResult:
    """Run every shard in this process, one after another, with one engine.

    Failures follow `runner.failures.decide`; a fatal engine error builds a new worker (a new engine)
    before the retry. There is no process to kill here: a worker crash is the driver's crash (a
    rerun resumes) and a hang is not cut short — the watchdog and poison-row isolation need
    `executor.kind=ray` (docs/reliability.md).
    """
    result = ExecResult()
    if not shards:
        return result
    workers = [ShardWorker(job, ctx, name="local")]  # the last one is in use; a fatal error appends another
    try:
        return _run_all(job, ctx, workers, shards, stop, progress, result)
    finally:
        for w in workers:  # a tensor-parallel engine's other ranks end with it
            w.close()


def _run_all(job: JobConfig, ctx: WorkerContext, workers: list[ShardWorker], shards: list[ShardSpec],
             stop: StopFlag, progress: Progress, result: ExecResult) -> ExecResult:
    worker = workers[-1]
    progress.restart_clock()
    queue = deque(Work(spec, 1) for spec in shards)
    while queue:
        if stop.requested:
            result.interrupted = True
            break
        work = queue.popleft()
        summary = worker.run_shard(work.spec, work.attempt)
        if "failure" in summary:  # any failure of one shard is retried, then reported, never swallowed
            failure = WorkerFailure.from_dict(summary["failure"])
            result.record(failure)
            progress.metrics.failed(failure.kind)
            decision = decide(work, failure.kind, job.executor.max_attempts)
            if decision.abort:
                result.aborted = failure
                break
            if failure.kind == FATAL:
                worker.close()
                worker = ShardWorker(job, ctx, name=f"local-{work.spec.shard_id}-{work.attempt}")
                workers.append(worker)
            queue.extendleft(reversed(decision.retry))
            if decision.fail:
                result.failed[work.spec.shard_id] = failure.line
            continue
        result.done.append(work.spec.shard_id)
        progress.advance(summary["rows"], summary["output_tokens"])
        progress.metrics.committed(summary, summary.get("wall_s"))
    return result
