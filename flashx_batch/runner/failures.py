"""What happens when one try of a piece fails: retry, split, give its rows up as error rows, or fail.

Who calls it: both executors (`runner.executor.run_local`, `runner.ray_executor.RayExecutor`)
classify each failure (`kind_of`) and follow `decide`; `FailedRows` is how they commit the rows
they give up, through the same commit protocol as generated rows. Kept free of Ray so the policy
is a pure function the unit tests walk through.

Policy (exit codes: docs/reliability.md "Exit codes"):
  error   an exception in the worker (a bug, ENOSPC): retry up to max_attempts, then the job
          fails with exit 1 and a rerun retries it — the rows are not ours to give up.
  fatal   the engine's device is gone, or a rank of its tensor-parallel replica: the worker (the
          whole replica) is replaced, never reused, then as `error`.
  bad_job the job as written cannot succeed (an input file changed under it, a config error the
          engine found): no retry, the job stops (exit 2) naming the cause.
  timeout the watchdog killed a piece over its budget: retry, then `timeout` error rows.
  died    the worker process died: a whole piece gets one more try (preemption, OOM killer, a
          test's ray.kill); after that it is split in halves, which keep its attempt number, until
          the row that kills the worker is alone; that row becomes a `worker_crash` error row after
          max_attempts, and the rest of the shard commits.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from flashx_batch.backends.distributed import ReplicaBroken
from flashx_batch.data.plan import ShardSpec
from flashx_batch.errors import ConfigError, ModelLoadError
from flashx_batch.job_errors import FatalEngineError
from flashx_batch.runner import pieces
from flashx_batch.tasks.tables import errors_table

if TYPE_CHECKING:
    from flashx_batch.runner.outputs import Output

TIMEOUT, WORKER_CRASH = "timeout", "worker_crash"  # error_code of rows given up at run time
ERROR, FATAL, DIED, BAD_JOB = "error", "fatal", "died", "bad_job"  # failure kinds (TIMEOUT is one too)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # Ray colours its error headers
_FRAMES = 6  # innermost frames kept: enough to see where, short enough to read in a log
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
    abort: bool = False  # the job can never finish as written: stop dispatching (exit 2)


def kind_of(exc: BaseException) -> str:
    """`bad_job` for a config / model / input problem, `fatal` for a dead engine (ours, or a device
    error by its message), else `error`."""
    chain = (exc, _ray_cause(exc), exc.__cause__)
    if any(isinstance(e, (ConfigError, ModelLoadError)) for e in chain):
        return BAD_JOB
    for e in chain:
        if isinstance(e, FatalEngineError | ReplicaBroken) or (isinstance(e, RuntimeError) and any(
                m in str(e) for m in _FATAL_MARKERS)):
            return FATAL
    return ERROR


def _ray_cause(exc: BaseException) -> BaseException | None:
    """The worker's own exception inside Ray's RayTaskError wrapper (`.cause`), if this is one."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else None


def clean(text: str) -> str:
    """Text without terminal colour codes (Ray's error headers carry them)."""
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class WorkerFailure:
    """One failed try, as data: what the driver logs in one block and keeps in job.json.

    Built in the worker from the exception itself, so the real type, message and innermost frames
    reach the user, not the wrapper Ray puts around them."""

    kind: str  # error | fatal | bad_job | died | timeout
    type: str
    message: str
    frames: tuple[str, ...] = ()
    node: str = ""
    worker: str = ""
    shard_id: str = ""
    attempt: int = 0

    @classmethod
    def from_exception(cls, exc: BaseException, *, node: str = "", worker: str = "", shard_id: str = "",
                       attempt: int = 0, kind: str | None = None) -> WorkerFailure:
        exc = _ray_cause(exc) or exc  # Ray's wrapper: the worker's own exception is inside
        frames = tuple(f"{f.filename}:{f.lineno} in {f.name}"
                       for f in traceback.extract_tb(exc.__traceback__)[-_FRAMES:])
        return cls(kind or kind_of(exc), type(exc).__name__, clean(str(exc)).strip() or type(exc).__name__,
                   frames, node, worker, shard_id, attempt)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerFailure:
        return cls(**{**d, "frames": tuple(d.get("frames", ()))})

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "frames": list(self.frames)}

    @property
    def line(self) -> str:
        """`Type: first line of the message`: for one-line summaries (error tables, job.json lists)."""
        first = next((x for x in self.message.splitlines() if x.strip()), "")
        return f"{self.type}: {first}"

    def block(self) -> str:
        """The readable block the driver logs: where, what, and the innermost frames."""
        where = ", ".join(x for x in (f"worker {self.worker}" if self.worker else "",
                                      f"node {self.node}" if self.node else "") if x)
        head = f"shard {self.shard_id} attempt {self.attempt} failed ({self.kind}){' on ' + where if where else ''}"
        lines = [head, f"  {self.type}: {self.message}".replace("\n", "\n    ")]
        if self.frames:
            lines.append("  innermost frames:")
            lines += [f"    {f}" for f in self.frames]
        return "\n".join(lines)


def decide(work: Work, kind: str, max_attempts: int) -> Decision:
    """The next step after `work` failed with `kind` (see the module docstring)."""
    spec, attempt = work.spec, work.attempt
    more = attempt < max_attempts
    if kind == BAD_JOB:
        return Decision(fail=True, abort=True)
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

    def __init__(self, output: Output, id_of: dict[tuple[int, int], Any], id_kind: str) -> None:
        self.output, self.id_of, self.id_kind = output, id_of, id_kind

    def commit(self, work: Work, code: str, message: str) -> int:
        """Write one error row per row of the piece; returns the number of rows committed (0 when the
        piece was committed meanwhile)."""
        ids = [self.id_of[ref] for ref in work.spec.refs]
        table = errors_table(ids, self.id_kind, [code] * len(ids), [message] * len(ids), ["generate"] * len(ids))
        won = self.output.commit(work.spec.shard_id, work.attempt, {"errors": table},
                                 {"kind": code, "rows": 0, "rows_failed": len(ids), "worker": "driver",
                                  "finished_at": time.time()})
        return len(ids) if won else 0  # a late attempt committed the piece first: its rows are counted there
