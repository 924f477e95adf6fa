"""`run(JobConfig) -> exit code`: one batch job from preflight to `_SUCCESS`.

Who calls it: `flashx_batch.cli` (once per Hydra run, multirun included), `jobs/*.py` and tests.
Steps: preflight + plan (read and check the input, the model's config and weight headers, the
tokenizer, the backend; tokenize, shard) → dry run stops here → (Ray: start it and probe one
worker) → take the output directory's lock → under the lock: read job.json, compare fingerprints,
clean orphans → commit plan-time error rows → execute pending shards → check the input files are
unchanged → verify the invariant → report → `_SUCCESS`. Every run that opened the output directory
records its row accounting (in = generated + errors + pending) and a final status in job.json,
however it ends.

Exit codes (`EXIT_*`, the table in docs/reliability.md): 0 done, or already done (`_SUCCESS` left
untouched); 2 the job as written can never succeed (config, schema, corrupt or changed input,
fingerprint mismatch, a model that cannot load); 75 try again later (another live run holds the
lock); 130 / 143 interrupted, at any moment; 1 anything else (a shard failing every attempt, a
full disk: resumable).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import flashx_batch
from flashx_batch import storage
from flashx_batch.backends import resolved_run
from flashx_batch.config import JobConfig, resolve_data_path, resolve_model_dir, validate
from flashx_batch.data import openai_batch
from flashx_batch.data.plan import Plan, build_plan, format_plan
from flashx_batch.data.preflight import LoadedInput, load_inputs
from flashx_batch.data.readers import resolve_inputs, verify_unchanged
from flashx_batch.data.validate import RowProblem, check_tools
from flashx_batch.errors import ConfigError, FlashxError, ModelLoadError
from flashx_batch.job_errors import FingerprintMismatchError, LockHeldError, ShardFailedError
from flashx_batch.runner import faults, fingerprint, openai_output, pieces
from flashx_batch.runner.durable import write_atomic
from flashx_batch.runner.executor import ExecResult, run_local
from flashx_batch.runner.failures import FailedRows
from flashx_batch.runner.layout import TornJobJsonError
from flashx_batch.runner.metrics import JobMetrics
from flashx_batch.runner.outputs import Output, check_output_location, open_output, output_root
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.signals import Interrupted, StopFlag
from flashx_batch.runner.tables import errors_table, reserved_column_problem
from flashx_batch.runner.verify import verify_output
from flashx_batch.runner.worker import WorkerContext

log = logging.getLogger(__name__)
EXIT_OK, EXIT_FAILED, EXIT_BAD_JOB, EXIT_TEMPFAIL = 0, 1, 2, 75
_FAILURES_KEPT = 20  # failed tries recorded in job.json (the log has them all)
# OSErrors that are the machine's state, not a bug: reported in one line, not a traceback
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


class JobAborted(ConfigError):
    """A worker found the job cannot succeed as written (an input file changed, a config problem)."""


def run(job: JobConfig, *, out: TextIO | None = None,
        on_dispatch: Callable[[Any, int, str], None] | None = None) -> int:
    """Run (or resume) `job`; returns the process exit code. Never raises for a job-level problem."""
    stop = StopFlag(job.executor.grace_period_s, immediate=True)
    try:
        with stop:
            return _run(job, out or sys.stdout, on_dispatch, stop)
    except Interrupted as exc:
        return exc.code
    except KeyboardInterrupt:  # a SIGINT where our handler was not installed (not the main thread)
        return 130
    except LockHeldError as exc:
        log.error("%s", exc)
        return EXIT_TEMPFAIL
    except (ConfigError, ModelLoadError) as exc:  # a model that cannot load is the job's, not the machine's
        log.error("%s", exc)
        return EXIT_BAD_JOB
    except FlashxError as exc:
        log.error("%s", exc)
        return EXIT_FAILED
    except OSError as exc:
        if exc.errno not in _ENVIRONMENT_ERRNOS:
            log.exception("job failed")
            return EXIT_FAILED
        log.error("job failed: %s%s. Fix the cause and rerun the same command (committed shards, if any, are "
                  "kept).",
                  exc.strerror or exc, f" ({exc.filename})" if exc.filename else "")
        return EXIT_FAILED
    except Exception:
        log.exception("job failed")
        return EXIT_FAILED


@dataclass
class PlannedJob:
    """A checked, planned job: `job` as it runs (a copy of the caller's, its input format's keys and the
    passthrough columns the input has resolved), the model directory, the checked input and the plan."""

    job: JobConfig
    model_dir: Path
    loaded: LoadedInput
    plan: Plan


def plan_job(job: JobConfig) -> PlannedJob:
    """Validate the config, check the model and the input, and build the shard plan (writes nothing)."""
    validate(job)
    storage.configure(job.storage.settings())
    faults.load(job.executor.faults, quiet=True)  # a malformed fault spec: a bad job (exit 2) before anything runs
    check_output_location(job.output.dir)
    if job.data.format == "openai_batch":  # the data keys point at the columns its requests read as
        files = resolve_inputs(resolve_data_path(job.data.path), "openai_batch")
        job = openai_batch.derive(job, openai_batch.endpoint_of([f.path for f in files]))
    problem = reserved_column_problem([*job.data.passthrough_columns, *job.data.passthrough_if_present], job.task)
    if problem:
        raise ConfigError(problem)
    if job.data.tools:  # one list for every row: a bad one is a bad job, not a column of error rows
        tools = check_tools(list(job.data.tools), job.data.max_row_bytes, "data.tools")
        if isinstance(tools, RowProblem):
            raise ConfigError(tools.message + ".")
    model_dir = resolve_model_dir(job.model.path)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path={job.model.path}: {model_dir} is not a model directory (no config.json).")
    from flashx_batch.runtime.tokenizer import Tokenizer  # the driver needs the tokenizer, not the weights

    try:
        preflight_model(job, model_dir)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    try:
        tokenizer = Tokenizer(model_dir)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # a tokenizer.json the tokenizers library cannot parse, say
        raise ConfigError(f"model.path={job.model.path}: cannot load the tokenizer: {type(exc).__name__}: {exc}") \
            from None
    if job.data.messages_column and not tokenizer.chat_template:
        raise ConfigError(f"data.messages_column={job.data.messages_column} needs a chat template, and "
                          f"{model_dir} has none.")
    data_path = resolve_data_path(job.data.path)
    out = output_root(job.output.dir)
    if _reads_outputs_of(data_path, out):
        raise ConfigError(f"output.dir={job.output.dir} is inside data.path={job.data.path}: every rerun would read "
                          "the job's own outputs as input. Put output.dir outside the input.")
    loaded = load_inputs(job.data, data_path, refuse_under=out if isinstance(out, Path) else None,
                         extra_columns=job.extra_columns(), task=job.task)
    # the passthrough columns as found: the workers read, and the fingerprint records, these
    job = replace(job, data=replace(job.data, passthrough_columns=loaded.passthrough))
    return PlannedJob(job, model_dir, loaded, build_plan(job, loaded, tokenizer))


def preflight_model(job: JobConfig, model_dir: Path) -> None:
    """What an engine would refuse at load, found without loading it: the checkpoint (architecture,
    weight headers against config.json) and the engine's own option checks, with the backend where
    this process runs it (the local executor; Ray jobs probe the backend on a worker instead)."""
    from flashx_batch.backends import check_known, get_backend
    from flashx_batch.models.loader import check_checkpoint
    from flashx_batch.runtime.engine import check_options

    cfg = check_checkpoint(model_dir)
    options = job.engine_options()
    check_known(options.backend)
    local = job.executor.kind == "local" and options.backend != "onnx"
    check_options(options, cfg, get_backend(options.backend) if local else None)


def _reads_outputs_of(data_path: str, out: Path | str) -> bool:
    """Would `data_path` pick up the Parquet files a job writes under `out` (a data.path directory is
    read recursively; a glob is matched as glob.glob(recursive=True) would)? Checked before the first
    run writes any; `load_inputs(refuse_under=)` catches the files already there."""
    if storage.is_remote(data_path) or isinstance(out, str):
        if not (storage.is_remote(data_path) and isinstance(out, str)):
            return False  # one local, one remote: never the same files
        if not any(ch in data_path for ch in "*?["):
            return (out + "/").startswith(data_path.rstrip("/") + "/")
        return storage.glob_match(tuple(data_path.split("/")), tuple(f"{out}/generations/part-x.parquet".split("/")))
    if not any(ch in data_path for ch in "*?["):
        base = Path(data_path).expanduser().resolve()
        return base.is_dir() and (out == base or base in out.parents)
    pattern = Path(data_path).expanduser().absolute()
    return storage.glob_match(pattern.parts, (out / "generations" / "part-x.parquet").parts)


def _run(job: JobConfig, out: TextIO, on_dispatch: Callable | None, stop: StopFlag) -> int:
    planned = plan_job(job)
    job, model_dir, loaded, plan = planned.job, planned.model_dir, planned.loaded, planned.plan
    if job.dry_run:
        out.write(format_plan(plan) + "\n")
        out.write(f"dry run: {len(plan.shards)} {job.task} shard(s) planned; nothing was written.\n")
        return EXIT_OK
    output = open_output(job.output.dir, faults.driver_faults(job.executor.faults))
    wrote = False
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: output.unlock(clean=not wrote))  # runs last: after Ray (and every actor) is down
        resolved_as = None  # backend/dtype as the engines will run (unknown for a finished Ray job: no cluster)
        if job.executor.kind == "ray" and not output.is_finished():  # a finished job needs no Ray
            from flashx_batch.runner.ray_cluster import probe_cluster, ray_session

            stack.enter_context(ray_session(job, stop))
            resolved_as = probe_cluster(job)
        elif job.executor.kind != "ray":  # the engines run in this process
            resolved_as = resolved_run(job.runtime.backend, job.model.dtype)
        output.lock()
        previous, committed = _open_previous(output)
        model_stats = fingerprint.model_file_stats(model_dir, (previous or {}).get("model_file_stats"))
        fp = fingerprint.compute(job, plan, model_stats, resolved_as)
        differences = fingerprint.diff(previous.get("fingerprint", {}), fp) if previous is not None else []
        # a job finished under earlier row rules is still finished: nothing to rerun, nothing rewritten
        rules_only = all(d.startswith(fingerprint.ROW_RULES_KEY + ":") for d in differences)
        if previous is not None and rules_only and _already_done(previous, committed, plan, output):
            log.info("%s: already done (_SUCCESS); nothing to run, nothing rewritten", output.root)
            if job.output.format == "openai_batch" and not output.has_file(openai_output.FILE_NAME):
                _write_openai_output(job, output, committed, model_dir)  # asked for after the job finished
            return EXIT_OK
        if differences and not _replaceable(committed, output):
            raise FingerprintMismatchError(str(output.root), differences + fingerprint.input_changes(previous, plan))
        wrote = True
        stop.immediate = False  # from here on the output is ours: signals drain, never cut a write
        if differences:
            log.warning("%s: replacing the job.json of a run that committed no generated row (%s)",
                        output.root, "; ".join(differences[:3]))
            output.reset()
            previous = None
        # only now, once this job owns the directory: pieces stamped by another job are un-committed
        output.job_digest = fingerprint.digest(fp)
        committed = output.committed()
        return _execute(job, plan, loaded, model_dir, output, previous, committed, fp, model_stats,
                        on_dispatch, stop)


def _open_previous(output: Output) -> tuple[dict | None, dict[str, dict]]:
    """(job.json, committed pieces) under the lock; a torn job.json is replaceable only when nothing
    but driver-written plan errors was committed (there is nothing else to resume)."""
    try:
        previous = output.read_job()
    except TornJobJsonError as exc:
        if not _no_generated_rows(output.committed()):
            raise TornJobJsonError(f"{exc} The committed shards cannot be matched to a configuration without it: "
                                   "restore job.json from a backup, or run into a new output.dir.") from None
        log.warning("%s; no generated row was committed, so the directory is started afresh", exc)
        output.reset()
        return None, {}
    return previous, output.committed()


def _already_done(previous: dict, committed: dict[str, dict], plan: Plan, output: Output) -> bool:
    """Same fingerprint (the caller's check), _SUCCESS present, every planned shard committed: a rerun
    of a finished job. Nothing is rewritten (downstream sensors watch `_SUCCESS`)."""
    return output.is_finished() and previous.get("status") == "succeeded" and \
        not any(pieces.uncovered(s, committed) for s in [*plan.shards, *plan.error_shards])


def _no_generated_rows(committed: dict[str, dict]) -> bool:
    """Only driver-written plan-error pieces (kind `invalid`) are committed, or none: nothing to resume."""
    return all(m.get("kind") == "invalid" for m in committed.values())


def _replaceable(committed: dict[str, dict], output: Output) -> bool:
    """A job that never committed a generated row and never finished (it failed at engine load, say)
    holds nothing worth keeping: a corrected run may replace it instead of being refused."""
    return not output.is_finished() and _no_generated_rows(committed)


def _execute(job: JobConfig, plan: Plan, loaded: LoadedInput, model_dir: Path, output: Output,
             previous: dict | None, committed: dict[str, dict], fp: dict, model_stats: dict,
             on_dispatch: Callable | None, stop: StopFlag) -> int:
    record = {
        "status": "running", "fingerprint": fp, "config": {**asdict(job), "storage": job.storage.settings().masked()},
        "plan": plan.summary(),
        "input_files": [f.manifest() for f in plan.files],
        "model_dir": str(model_dir), "model_file_stats": model_stats, "versions": _versions(),
        "runs": [*(previous or {}).get("runs", []), {"started_at": time.time(), "resumed_shards": len(committed)}],
    }

    final: str | None = None  # the status finish() last wrote to job.json

    def finish(status: str, snapshot: dict[str, dict] | None = None, **extra: Any) -> None:
        """job.json with `status`; `snapshot`: the committed pieces to count (default: as they are now)."""
        nonlocal final
        counted = snapshot if snapshot is not None else output.committed()
        output.write_job({**record, "status": status, "accounting": accounting(plan, counted), **extra})
        final = status

    stop.set_on_force(lambda code: finish("interrupted", exit_code=code))  # last words before os._exit
    try:
        output.prepare()
        output.clean_orphans(committed)
        output.write_job(record)
        return _run_pending(job, plan, loaded, model_dir, output, model_stats, finish, on_dispatch, stop,
                            fp.get("runtime.resolved"))
    except BaseException as exc:  # whatever ends the run, job.json says how, with its accounting
        with contextlib.suppress(OSError):
            output.unmark_finished()  # a half-written success is no success
        if final in (None, "succeeded"):
            status, extra = _status_of(exc)
            try:
                finish(status, **extra)
            except OSError as write_exc:
                log.error("could not record the final status in %s (%s); the committed shards are safe, and "
                          "a rerun recomputes the status", output.job_json, write_exc)
        raise
    finally:
        stop.set_on_force(None)


def _status_of(exc: BaseException) -> tuple[str, dict[str, Any]]:
    if isinstance(exc, Interrupted):
        return "interrupted", {"exit_code": exc.code}
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", {"exit_code": 130}
    reason = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):
        reason += " (the committed shards are safe; fix the cause, e.g. free disk space, and rerun)"
    return "failed", {"reason": reason}


def _run_pending(job: JobConfig, plan: Plan, loaded: LoadedInput, model_dir: Path, output: Output,
                 model_stats: dict, finish: Callable[..., None], on_dispatch: Callable | None, stop: StopFlag,
                 resolved_as: str | None = None) -> int:
    committed = output.committed()
    # A shard split by an earlier run (poison-row isolation) resumes as its uncommitted pieces only.
    pending = [p for s in plan.shards for p in pieces.uncovered(s, committed)]
    if pending or any(s.shard_id not in committed for s in plan.error_shards):
        output.unmark_finished()  # files removed since it finished: not finished now
    metrics = JobMetrics(str(output.root))  # live counters on Ray's metrics endpoint (a no-op without Ray)
    metrics.error_rows_committed(_commit_plan_errors(plan, output, set(committed)))
    log.info("%s: %d of %d shard(s) already committed, %d piece(s) to run", output.root,
             sum(not pieces.uncovered(s, committed) for s in plan.shards), len(plan.shards), len(pending))
    progress = Progress(plan.num_valid, plan.num_valid - sum(p.num_rows for p in pending),
                        job.executor.progress_interval_s, metrics=metrics)
    ctx = WorkerContext(str(model_dir), str(output.root), loaded.files, loaded.id_kind,
                        _passthrough_types(job, loaded), faults=faults.load(job.executor.faults),
                        job_digest=output.job_digest, model_files=model_stats, resolved=resolved_as)
    result = _dispatch(job, ctx, pending, stop, progress, on_dispatch, FailedRows(output, plan.ref_ids,
                                                                                   plan.id_kind))
    progress.close()
    committed = output.committed()
    remaining = [p for s in plan.shards for p in pieces.uncovered(s, committed)]
    counts = accounting(plan, committed)
    log.info("rows: %(input_rows)d in = %(generated_rows)d generated + %(error_rows)d error rows "
             "+ %(pending_rows)d not yet run", counts)
    failures = [f.as_dict() for f in result.failures[-_FAILURES_KEPT:]]
    if result.aborted is not None:
        finish("failed", reason=result.aborted.line, worker_failures=failures, nodes=result.nodes)
        raise JobAborted(f"{result.aborted.message} (found by {result.aborted.worker} on shard "
                         f"{result.aborted.shard_id})")
    if remaining and stop.requested:
        finish("interrupted", exit_code=stop.exit_code, worker_failures=failures, nodes=result.nodes)
        log.warning("interrupted: %d piece(s) committed this run, %d left; rerun the same command to resume",
                    len(result.done), len(remaining))
        return stop.exit_code
    if remaining:
        failed = result.failed or {p.shard_id: "not run" for p in remaining}
        finish("failed", failed_shards=failed, worker_failures=failures, nodes=result.nodes)
        not_run = sum(str(v).startswith("not run") for v in failed.values())
        raise ShardFailedError(
            f"{len(failed)} shard(s) not committed ({len(failed) - not_run} failed {job.executor.max_attempts} "
            f"time(s), {not_run} not run): "
            + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items())[:5])
            + ". Rerun the same command to retry them (committed shards are kept).")
    verify_unchanged(plan.files)  # the last word on the input: every row came from the planned bytes
    fingerprint.check_model_unchanged(model_dir, model_stats)
    # the pieces checked here are the ones counted, reported and written out, whatever commits later
    totals, verified = verify_output(plan, output, job.sampling.n)
    if stop.requested:  # a signal while finishing: stop before _SUCCESS; a rerun only finishes
        finish("interrupted", exit_code=stop.exit_code)
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
            write_report(where, totals, plan, stats, write_atomic, evaluation)
    if stop.requested:
        finish("interrupted", exit_code=stop.exit_code)
        return stop.exit_code
    if job.output.format == "openai_batch":  # from the verified pieces, before _SUCCESS: every custom_id once
        _write_openai_output(job, output, verified, model_dir)
    stop.set_on_force(None)  # past here a forced exit must not overwrite the success being written
    finish("succeeded", verified, totals=totals, finished_at=time.time(), worker_failures=failures,
           nodes=result.nodes)
    output.finish(totals, verified, {"errors": errors_table([], plan.id_kind, [], [], [])})
    log.info("done: %d generated, %d error rows, %d output tokens -> %s", totals["generated_rows"],
             totals["error_rows"], totals["output_tokens"], output.root)
    return EXIT_OK


def _write_openai_output(job: JobConfig, output: Output, committed: dict[str, dict], model_dir: Path) -> None:
    from flashx_batch.runtime.tokenizer import Tokenizer

    lines = openai_output.write(output, job, committed, Path(model_dir).name, int(time.time()),
                                Tokenizer(model_dir).decode)
    log.info("%s: %d line(s)", openai_output.FILE_NAME, lines)


def accounting(plan: Plan, committed: dict[str, dict]) -> dict[str, int]:
    """Row accounting from the manifests (cheap: no Parquet read): in = generated + errors + pending."""
    gen = sum(m.get("rows", 0) for m in committed.values())
    err = sum(m.get("rows_failed", 0) for m in committed.values())
    return {"input_rows": plan.num_rows, "generated_rows": gen, "error_rows": err,
            "pending_rows": plan.num_rows - gen - err, "committed_pieces": len(committed)}


def _dispatch(job: JobConfig, ctx: WorkerContext, pending: list, stop: StopFlag, progress: Progress,
              on_dispatch: Callable | None, failed_rows: FailedRows) -> ExecResult:
    if job.executor.kind == "local":
        return run_local(job, ctx, pending, stop, progress)
    from flashx_batch.runner.ray_executor import RayExecutor  # Ray is imported only when used

    return RayExecutor(job, ctx, failed_rows, on_dispatch).run(pending, stop, progress)


def _commit_plan_errors(plan: Plan, output: Output, committed: set[str]) -> int:
    """Rows rejected while planning go through the same commit protocol as generated ones; returns how
    many this call committed."""
    count = 0
    for spec in plan.error_shards:
        if spec.shard_id in committed:
            continue
        rows = plan.row_errors[spec.shard_id]
        table = errors_table([r.id for r in rows], plan.id_kind, [r.code for r in rows], [r.message for r in rows],
                             [r.stage for r in rows])
        output.commit(spec.shard_id, 1, {"errors": table}, {"kind": "invalid", "rows": 0, "rows_failed": len(rows),
                                                            "worker": "driver"})
        count += len(rows)
    return count


def _passthrough_types(job: JobConfig, loaded: LoadedInput) -> dict[str, Any]:
    """Each passthrough column's type (the first non-null one the input checks saw)."""
    return {c: loaded.passthrough_types[c] for c in job.data.passthrough_columns if c in loaded.passthrough_types}


def _versions() -> dict[str, str]:
    import pyarrow
    import torch

    return {"flashx_batch": flashx_batch.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "pyarrow": pyarrow.__version__}


def _json(value: dict) -> str:
    import json

    return json.dumps(value, indent=2, default=str) + "\n"
