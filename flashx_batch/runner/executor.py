"""What every executor returns, and the in-process (`executor.kind=local`) executor.

Who calls it: `runner.job.run` picks `run_local` or `runner.ray_executor.RayExecutor.run`; both take
the pending shards in dispatch order (longest buckets first), honour the stop flag between shards,
retry a failing shard up to `executor.max_attempts`, and report progress.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from flashx_batch.config import JobConfig
from flashx_batch.data.plan import ShardSpec
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.signals import StopFlag
from flashx_batch.runner.worker import ShardWorker, WorkerContext

log = logging.getLogger(__name__)


@dataclass
class ExecResult:
    done: list[str] = field(default_factory=list)  # shard ids committed by this run
    failed: dict[str, str] = field(default_factory=dict)  # shard id -> last error, after max_attempts
    interrupted: bool = False


def run_local(job: JobConfig, ctx: WorkerContext, shards: list[ShardSpec], stop: StopFlag,
              progress: Progress) -> ExecResult:
    """Run every shard in this process, one after another, with one engine."""
    result = ExecResult()
    if not shards:
        return result
    worker = ShardWorker(job, ctx, name="local")
    progress.restart_clock()
    for spec in shards:
        if stop.requested:
            result.interrupted = True
            break
        for attempt in range(1, job.executor.max_attempts + 1):
            try:
                summary = worker.run_shard(spec, attempt)
            except Exception as exc:  # any failure of one shard is retried, then reported, never swallowed
                log.warning("shard %s attempt %d failed: %s", spec.shard_id, attempt, exc, exc_info=True)
                if attempt == job.executor.max_attempts:
                    result.failed[spec.shard_id] = f"{type(exc).__name__}: {exc}"
                continue
            result.done.append(spec.shard_id)
            progress.advance(summary["rows"], summary["output_tokens"])
            break
    return result
