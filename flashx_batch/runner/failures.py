"""What happens when one try of a piece fails: retry, split, give its rows up as error rows, or fail.

Who calls it: both executors (`runner.executor.run_local`, `runner.ray_executor.RayExecutor`)
classify each failure (`kind_of`) and follow `decide`; `FailedRows` is how they commit the rows
they give up, through the same commit protocol as generated rows. Kept free of Ray so the policy
is a pure function the unit tests walk through.

Policy (DESIGN.md exit codes, docs/reliability.md):
  error   an exception in the worker (a bug, ENOSPC): retry up to max_attempts, then the job
          fails with exit 1 and a rerun retries it — the rows are not ours to give up.
  fatal   the engine's device is gone: the worker is replaced (never reused), then as `error`.
  timeout the watchdog killed a piece over its budget: retry, then `timeout` error rows.
  died    the worker process died: a whole piece gets one more try (preemption, OOM killer, a
          test's ray.kill); after that it is split in halves, which keep its attempt number, until
          the row that kills the worker is alone; that row becomes a `worker_crash` error row after
          max_attempts, and the rest of the shard commits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from flashx_batch.data.plan import ShardSpec
from flashx_batch.job_errors import FatalEngineError
from flashx_batch.runner import pieces
from flashx_batch.runner.layout import OutputDir
from flashx_batch.runner.tables import errors_table

TIMEOUT, WORKER_CRASH = "timeout", "worker_crash"  # error_code of rows given up at run time
ERROR, FATAL, DIED = "error", "fatal", "died"  # failure kinds (TIMEOUT is one too)
# Messages of device failures that leave an engine unusable (torch / vendor runtimes word them so).
_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "HIP error", "ACL error",
                  "NPU function error", "uncorrectable ECC")


@dataclass(frozen=True)
class Work:
    """One try to make: a piece (a planned shard or a part of one) and its attempt number."""

    spec: ShardSpec
    attempt: int


@dataclass(frozen=True)
class Decision:
    retry: tuple[Work, ...] = ()  # tries to queue next (front of the queue)
    give_up: str | None = None  # error_code for every row of the piece
    fail: bool = False  # the job cannot finish this run (exit 1, resumable)


def kind_of(exc: BaseException) -> str:
    """`fatal` for a dead engine (ours, or a device error by its message), else `error`."""
    cause = getattr(exc, "cause", None)  # Ray wraps a task's exception in RayTaskError(.cause)
    for e in (exc, cause, exc.__cause__):
        if isinstance(e, FatalEngineError) or (isinstance(e, RuntimeError) and any(
                m in str(e) for m in _FATAL_MARKERS)):
            return FATAL
    return ERROR


def decide(work: Work, kind: str, max_attempts: int) -> Decision:
    """The next step after `work` failed with `kind` (see the module docstring)."""
    spec, attempt = work.spec, work.attempt
    more = attempt < max_attempts
    if kind in (ERROR, FATAL):
        return Decision(retry=(Work(spec, attempt + 1),)) if more else Decision(fail=True)
    if kind == TIMEOUT:
        return Decision(retry=(Work(spec, attempt + 1),)) if more else Decision(give_up=TIMEOUT)
    if kind != DIED:
        raise ValueError(f"unknown failure kind {kind!r}")
    if spec.num_rows == 1:
        return Decision(retry=(Work(spec, attempt + 1),)) if more else Decision(give_up=WORKER_CRASH)
    if attempt == 1 and more:
        return Decision(retry=(Work(spec, 2),))
    left, right = pieces.split(spec)
    return Decision(retry=(Work(left, attempt), Work(right, attempt)))


class FailedRows:
    """Commits the rows of a piece the executor gave up on as error rows (driver side)."""

    def __init__(self, output: OutputDir, id_of: dict[tuple[int, int], Any], id_kind: str) -> None:
        self.output, self.id_of, self.id_kind = output, id_of, id_kind

    def commit(self, work: Work, code: str, message: str) -> int:
        """Write one error row per row of the piece; returns the number of rows."""
        ids = [self.id_of[ref] for ref in work.spec.refs]
        table = errors_table(ids, self.id_kind, [code] * len(ids), [message] * len(ids), ["generate"] * len(ids))
        self.output.commit(work.spec.shard_id, work.attempt, {"errors": table},
                           {"kind": code, "rows": 0, "rows_failed": len(ids), "worker": "driver",
                            "finished_at": time.time()})
        return len(ids)
