"""One run of a planned job into its output directory, once the driver holds the directory's lock:
`JobRun.execute` records the run in job.json, commits the plan's error rows, hands the pending pieces
to an executor, checks the inputs and the model are unchanged, verifies the exactly-once invariant,
evaluates, reports and writes `_SUCCESS`. Whatever ends it, job.json says how, with its row accounting.

Who calls it: `runner.job._run`, after the fingerprint check (`runner.job` owns preflight, planning,
the lock and the exit codes; this module owns what happens under the lock).
"""

from __future__ import annotations

import contextlib
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import flashx_batch
from flashx_batch.config import JobConfig
from flashx_batch.data.plan import Plan
from flashx_batch.data.preflight import LoadedInput
from flashx_batch.data.readers import verify_unchanged
from flashx_batch.job_errors import JobAborted, ShardFailedError
from flashx_batch.runner import faults, fingerprint, openai_output, pieces
from flashx_batch.runner.durable import write_atomic
from flashx_batch.runner.executor import ExecResult, run_local
from flashx_batch.runner.failures import FailedRows
from flashx_batch.runner.metrics import JobMetrics
from flashx_batch.runner.outputs import Output
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.signals import Interrupted, StopFlag
from flashx_batch.runner.verify import verify_output
from flashx_batch.runner.worker import WorkerContext
from flashx_batch.tasks import Task, get_task
from flashx_batch.tasks.tables import errors_table

log = logging.getLogger(__name__)
EXIT_OK = 0
_FAILURES_KEPT = 20  # failed tries recorded in job.json (the log has them all)


@dataclass
class PlannedJob:
    """A checked, planned job: `job` as it runs (a copy of the caller's, its input format's keys, the
    passthrough columns the input has and the task's natural metric resolved), the model directory, the
    checked input and the plan."""

    job: JobConfig
    model_dir: Path
    loaded: LoadedInput
    plan: Plan
    metric_from_task: bool = False  # `job.eval.metric` is the task's default, not the user's setting
    # chat answers split by the model's template into reasoning / tool calls / answer (`tasks.generate.chat_format`):
    # in the fingerprint, so a chat job written before answers were split never resumes into mixed pieces
    answer_format: str | None = None
    adapter_digests: dict[str, str] = field(default_factory=dict)  # model.lora_adapters: name -> content digest

    @property
    def task(self) -> Task:
        return get_task(self.job.task)


@dataclass
class JobRun:
    """One run's state: the planned job, its locked output directory, the fingerprint it runs under
    (`fp`, with the model files' stats), the job.json of earlier runs (`previous`), the stop flag, and
    what job.json records of this run (`record`, `final`: the status last written)."""

    planned: PlannedJob
    output: Output
    fp: dict[str, Any]
    model_stats: dict[str, Any]
    previous: dict | None
    stop: StopFlag
    on_dispatch: Callable | None = None
    record: dict[str, Any] = field(default_factory=dict)
    final: str | None = None

    @property
    def job(self) -> JobConfig:
        return self.planned.job

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    def execute(self) -> int:
        """Run the pending pieces and finish the job; returns the exit code (raises for a failed run)."""
        job, output = self.job, self.output
        committed = output.committed()
        self.record = {
            "status": "running", "fingerprint": self.fp,
            "config": {**asdict(job), "storage": job.storage.settings().masked()},
            "plan": self.plan.summary(), "input_files": [f.manifest() for f in self.plan.files],
            "model_dir": str(self.planned.model_dir), "model_file_stats": self.model_stats, "versions": _versions(),
            "runs": [*(self.previous or {}).get("runs", []),
                     {"started_at": time.time(), "resumed_shards": len(committed)}],
        }
        self.stop.set_on_force(lambda code: self.finish("interrupted", exit_code=code))  # last words before os._exit
        try:
            output.prepare()
            output.clean_orphans(committed)
            output.write_job(self.record)
            return self._run_pending()
        except BaseException as exc:  # whatever ends the run, job.json says how, with its accounting
            with contextlib.suppress(OSError):
                output.unmark_finished()  # a half-written success is no success
            if self.final in (None, "succeeded"):
                status, extra = _status_of(exc)
                try:
                    self.finish(status, **extra)
                except OSError as write_exc:
                    log.error("could not record the final status in %s (%s); the committed shards are safe, and "
                              "a rerun recomputes the status", output.job_json, write_exc)
            raise
        finally:
            self.stop.set_on_force(None)

    def finish(self, status: str, snapshot: dict[str, dict] | None = None, **extra: Any) -> None:
        """job.json with `status`; `snapshot`: the committed pieces to count (default: as they are now)."""
        counted = snapshot if snapshot is not None else self.output.committed()
        self.output.write_job({**self.record, "status": status, "accounting": accounting(self.plan, counted),
                               **extra})
        self.final = status

    def _run_pending(self) -> int:
        job, plan, output, stop = self.job, self.plan, self.output, self.stop
        committed = output.committed()
        # A shard split by an earlier run (poison-row isolation) resumes as its uncommitted pieces only.
        pending = [p for s in plan.shards for p in pieces.uncovered(s, committed)]
        if pending or any(s.shard_id not in committed for s in plan.error_shards):
            output.unmark_finished()  # files removed since it finished: not finished now
        metrics = JobMetrics(str(output.root))  # live counters on Ray's metrics endpoint (a no-op without Ray)
        metrics.error_rows_committed(self._commit_plan_errors(set(committed)))
        log.info("%s: %d of %d shard(s) already committed, %d piece(s) to run", output.root,
                 sum(not pieces.uncovered(s, committed) for s in plan.shards), len(plan.shards), len(pending))
        progress = Progress(plan.num_valid, plan.num_valid - sum(p.num_rows for p in pending),
                            job.executor.progress_interval_s, metrics=metrics,
                            tokens=self.planned.task.generates)
        result = self._dispatch(pending, progress)
        progress.close()
        committed = output.committed()
        remaining = [p for s in plan.shards for p in pieces.uncovered(s, committed)]
        log.info("rows: %(input_rows)d in = %(generated_rows)d computed + %(error_rows)d error rows "
                 "+ %(pending_rows)d not yet run", accounting(plan, committed))
        failures = [f.as_dict() for f in result.failures[-_FAILURES_KEPT:]]
        if result.aborted is not None:
            self.finish("failed", reason=result.aborted.line, worker_failures=failures, nodes=result.nodes)
            raise JobAborted(f"{result.aborted.message} (found by {result.aborted.worker} on shard "
                             f"{result.aborted.shard_id})")
        if remaining and stop.requested:
            self.finish("interrupted", exit_code=stop.exit_code, worker_failures=failures, nodes=result.nodes)
            log.warning("interrupted: %d piece(s) committed this run, %d left; rerun the same command to resume",
                        len(result.done), len(remaining))
            return stop.exit_code
        if remaining:
            failed = result.failed or {p.shard_id: "not run" for p in remaining}
            self.finish("failed", failed_shards=failed, worker_failures=failures, nodes=result.nodes)
            not_run = sum(str(v).startswith("not run") for v in failed.values())
            raise ShardFailedError(
                f"{len(failed)} shard(s) not committed ({len(failed) - not_run} failed {job.executor.max_attempts} "
                f"time(s), {not_run} not run): "
                + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items())[:5])
                + ". Rerun the same command to retry them (committed shards are kept).")
        return self._finish_verified(failures, result)

    def _finish_verified(self, failures: list[dict], result: ExecResult) -> int:
        """Every piece committed: check the inputs and the model, verify, evaluate, report, `_SUCCESS`."""
        job, plan, output, stop = self.job, self.plan, self.output, self.stop
        verify_unchanged(plan.files)  # the last word on the input: every row came from the planned bytes
        fingerprint.check_model_unchanged(self.planned.model_dir, self.model_stats)
        # the pieces checked here are the ones counted, reported and written out, whatever commits later
        totals, verified = verify_output(plan, output, job.sampling.n)
        if stop.requested:  # a signal while finishing: stop before _SUCCESS; a rerun only finishes
            self.finish("interrupted", exit_code=stop.exit_code)
            return stop.exit_code
        evaluation, stats = None, output.read_stats(verified)
        if job.eval.metric:
            from flashx_batch.runner.eval_summary import evaluate

            evaluation = evaluate(job, output, totals, stats, verified)
            totals["eval"] = evaluation["overall"]
            log.info("evaluation: %s", evaluation["describe"])
        if job.output.report:
            from flashx_batch.report import write_report

            with output.report_dir() as where:
                write_report(where, totals, plan, stats, write_atomic, evaluation, self.planned.task,
                             error_examples(output, verified, set(totals.get("error_counts") or {})))
        if stop.requested:
            self.finish("interrupted", exit_code=stop.exit_code)
            return stop.exit_code
        if job.output.format == "openai_batch":  # from the verified pieces, before _SUCCESS: every custom_id once
            write_openai_output(job, output, verified, self.planned.model_dir)
        stop.set_on_force(None)  # past here a forced exit must not overwrite the success being written
        self.finish("succeeded", verified, totals=totals, finished_at=time.time(), worker_failures=failures,
                    nodes=result.nodes)
        output.finish(totals, verified, {"errors": errors_table([], plan.id_kind, [], [], [])})
        log.info("done: %d %s, %d error rows, %d output tokens -> %s", totals["generated_rows"],
                 self.planned.task.verb, totals["error_rows"], totals["output_tokens"], output.root)
        return EXIT_OK

    def _dispatch(self, pending: list, progress: Progress) -> ExecResult:
        job, loaded, output = self.job, self.planned.loaded, self.output
        types = {c: loaded.passthrough_types[c] for c in job.data.passthrough_columns if c in loaded.passthrough_types}
        ctx = WorkerContext(str(self.planned.model_dir), str(output.root), loaded.files, loaded.id_kind, types,
                            faults=faults.load(job.executor.faults), job_digest=output.job_digest,
                            model_files=self.model_stats, resolved=self.fp.get("runtime.resolved"),
                            adapter_digests=self.planned.adapter_digests)
        failed_rows = FailedRows(output, self.plan.ref_ids, self.plan.id_kind)
        if job.executor.kind == "local":
            return run_local(job, ctx, pending, self.stop, progress, failed_rows)
        from flashx_batch.runner.ray_executor import RayExecutor  # Ray is imported only when used

        return RayExecutor(job, ctx, failed_rows, self.on_dispatch).run(pending, self.stop, progress)

    def _commit_plan_errors(self, committed: set[str]) -> int:
        """Rows rejected while planning go through the same commit protocol as generated ones; returns how
        many this call committed."""
        count, plan = 0, self.plan
        for spec in plan.error_shards:
            if spec.shard_id in committed:
                continue
            rows = plan.row_errors[spec.shard_id]
            table = errors_table([r.id for r in rows], plan.id_kind, [r.code for r in rows],
                                 [r.message for r in rows], [r.stage for r in rows])
            self.output.commit(spec.shard_id, 1, {"errors": table},
                               {"kind": "invalid", "rows": 0, "rows_failed": len(rows), "worker": "driver"})
            count += len(rows)
        return count


def write_openai_output(job: JobConfig, output: Output, committed: dict[str, dict], model_dir: Path) -> None:
    from flashx_batch.runtime.tokenizer import Tokenizer

    lines = openai_output.write(output, job, committed, Path(model_dir).name, int(time.time()),
                                Tokenizer(model_dir).decode)
    log.info("%s: %d line(s)", openai_output.FILE_NAME, lines)


def error_examples(output: Output, committed: dict[str, dict], codes: set[str]) -> dict[str, str]:
    """One error message per code in `codes` (the first found), reading error pieces only until every code
    has one (report.md shows it beside the code's fix)."""
    found: dict[str, str] = {}
    for piece, manifest in committed.items():
        if len(found) == len(codes):
            break
        if not manifest.get("rows_failed"):
            continue
        table = output.read_part("errors", piece, ["error_code", "error_message"], committed)
        for code, message in zip(*(table.column(c).to_pylist() for c in ("error_code", "error_message")),
                                 strict=True) if table is not None else ():
            found.setdefault(code, message)
    return {c: m for c, m in found.items() if c in codes}


def accounting(plan: Plan, committed: dict[str, dict]) -> dict[str, int]:
    """Row accounting from the manifests (cheap: no Parquet read): in = generated + errors + pending."""
    gen = sum(m.get("rows", 0) for m in committed.values())
    err = sum(m.get("rows_failed", 0) for m in committed.values())
    return {"input_rows": plan.num_rows, "generated_rows": gen, "error_rows": err,
            "pending_rows": plan.num_rows - gen - err, "committed_pieces": len(committed)}


def _status_of(exc: BaseException) -> tuple[str, dict[str, Any]]:
    if isinstance(exc, Interrupted):
        return "interrupted", {"exit_code": exc.code}
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", {"exit_code": 130}
    reason = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):
        reason += " (the committed shards are safe; fix the cause, e.g. free disk space, and rerun)"
    return "failed", {"reason": reason}


def _versions() -> dict[str, str]:
    import pyarrow
    import torch

    return {"flashx_batch": flashx_batch.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "pyarrow": pyarrow.__version__}
