"""The retry state machine both executors share: the queue of tries in dispatch order, and what each
try's outcome does to the job — a commit is counted; a failure is logged and recorded, then
`failures.decide` says whether the piece is retried (at the front of the queue: it is among the longest
left), split (a worker that died twice on it: isolate the row that kills it), given up as error rows
(`give_up`: a row that kills or hangs every worker), failed for this run (resumable), or whether the
whole job stops (`abort`: it can never succeed as written).

What stays with each executor is only what it alone has: the Ray executor's node book (placement,
exclusion) and actor replacement; the local executor's rebuilt engine after a fatal error.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from flashx_batch.data.plan import ShardSpec
from flashx_batch.runner.executor_result import ExecResult
from flashx_batch.runner.failures import DIED, Decision, FailedRows, Work, WorkerFailure, decide
from flashx_batch.runner.progress import Progress

log = logging.getLogger(__name__)


class Retries:
    def __init__(self, shards: list[ShardSpec], max_attempts: int, result: ExecResult, progress: Progress,
                 failed_rows: FailedRows | None) -> None:
        self.queue: deque[Work] = deque(Work(spec, 1) for spec in shards)
        self.max_attempts, self.result, self.progress, self.failed_rows = max_attempts, result, progress, failed_rows

    def succeeded(self, work: Work, summary: dict[str, Any], latency_s: float | None = None) -> None:
        self.result.done.append(work.spec.shard_id)
        self.progress.advance(summary["rows"], summary["output_tokens"])
        self.progress.metrics.committed(summary, latency_s)

    def failed(self, work: Work, failure: WorkerFailure) -> Decision:
        """Record a failed try and act on `decide`'s answer; returns it (the caller stops on `abort`)."""
        self.result.record(failure)
        self.progress.metrics.failed(failure.kind)
        decision = decide(work, failure.kind, self.max_attempts)
        if decision.abort:
            self.result.aborted = failure
            return decision
        self.queue.extendleft(reversed(decision.retry))  # front: they are among the longest left
        if len(decision.retry) == 2:
            log.warning("shard %s: its worker died again; split into %s and %s to isolate the row that kills it",
                        work.spec.shard_id, decision.retry[0].spec.shard_id, decision.retry[1].spec.shard_id)
        if decision.give_up is not None:
            self._give_up(work, decision.give_up, failure)
        if decision.fail:
            self.result.failed[work.spec.shard_id] = failure.line
        return decision

    def _give_up(self, work: Work, code: str, failure: WorkerFailure) -> None:
        """The piece's rows become `code` error rows (a row that kills or hangs every worker it meets)."""
        if self.failed_rows is None:
            raise RuntimeError(f"shard {work.spec.shard_id}: no FailedRows to commit its given-up rows to")
        message = (f"{'the worker process died' if failure.kind == DIED else 'timed out'} on this row "
                   f"{work.attempt} time(s); last: {failure.line}")
        given_up = self.failed_rows.commit(work, code, message)
        self.progress.advance(given_up, 0)
        self.progress.metrics.error_rows_committed(given_up)
