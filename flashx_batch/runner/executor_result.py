"""What every executor returns (`ExecResult`): the pieces committed, failed and aborted, every failed try."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from flashx_batch.runner.failures import WorkerFailure

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
