"""`run(JobConfig) -> exit code`: one batch job from preflight to `_SUCCESS`.

Who calls it: `flashx_batch.cli` (once per Hydra run, multirun included), `jobs/*.py` and tests.
Steps: plan (read, check, tokenize, shard) → dry run stops here → open the output directory
(fingerprint check, lock, clean orphans) → commit plan-time error rows → execute pending shards →
verify the invariant → report → `_SUCCESS`. Exit codes (DESIGN.md): 0 done, 2 bad job (nothing
written), 130 / 143 interrupted (resumable), 1 anything else.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import flashx_batch
from flashx_batch.config import JobConfig, resolve_data_path, resolve_model_dir, validate
from flashx_batch.data.plan import Plan, build_plan, format_plan
from flashx_batch.data.preflight import LoadedInput, load_inputs
from flashx_batch.errors import ConfigError, FlashxError, ModelLoadError
from flashx_batch.job_errors import FingerprintMismatchError, ShardFailedError
from flashx_batch.runner import fingerprint
from flashx_batch.runner.executor import ExecResult, run_local
from flashx_batch.runner.layout import SUCCESS, OutputDir, write_atomic
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.signals import StopFlag
from flashx_batch.runner.tables import errors_table
from flashx_batch.runner.worker import WorkerContext

log = logging.getLogger(__name__)
EXIT_OK, EXIT_FAILED, EXIT_BAD_JOB = 0, 1, 2


class InvariantError(FlashxError):
    """ids(generations) ⊎ ids(errors) != ids(input) after every shard committed: a bug, never expected."""


def run(job: JobConfig, *, out: TextIO | None = None,
        on_dispatch: Callable[[Any, int, str], None] | None = None) -> int:
    """Run (or resume) `job`; returns the process exit code. Never raises for a job-level problem."""
    try:
        return _run(job, out or sys.stdout, on_dispatch)
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_BAD_JOB
    except FlashxError as exc:
        log.error("%s", exc)
        return EXIT_FAILED
    except Exception:
        log.exception("job failed")
        return EXIT_FAILED


def plan_job(job: JobConfig) -> tuple[Path, LoadedInput, Plan]:
    """Validate the config, check the input and build the shard plan (writes nothing)."""
    validate(job)
    model_dir = resolve_model_dir(job.model.path)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path={job.model.path}: {model_dir} is not a model directory (no config.json).")
    from flashx_batch.runtime.tokenizer import Tokenizer  # the driver needs the tokenizer, not the weights

    try:
        tokenizer = Tokenizer(model_dir)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    if job.data.messages_column and not tokenizer.chat_template:
        raise ConfigError(f"data.messages_column={job.data.messages_column} needs a chat template, and "
                          f"{model_dir} has none.")
    loaded = load_inputs(job.data, resolve_data_path(job.data.path))
    return model_dir, loaded, build_plan(job, loaded, tokenizer)


def _run(job: JobConfig, out: TextIO, on_dispatch: Callable | None) -> int:
    model_dir, loaded, plan = plan_job(job)
    if job.dry_run:
        out.write(format_plan(plan) + "\n")
        out.write(f"dry run: {len(plan.shards)} generate shard(s) planned; nothing was written.\n")
        return EXIT_OK
    output = OutputDir(job.output.dir)
    previous = output.read_job()
    model_stats = fingerprint.model_file_stats(model_dir, (previous or {}).get("model_file_stats"))
    fp = fingerprint.compute(job, plan, model_stats)
    if previous is not None:
        differences = fingerprint.diff(previous.get("fingerprint", {}), fp)
        if differences:
            raise FingerprintMismatchError(str(output.root), differences)
    output.lock()
    try:
        return _execute(job, plan, loaded, model_dir, output, previous, fp, model_stats, on_dispatch)
    finally:
        output.unlock()


def _execute(job: JobConfig, plan: Plan, loaded: LoadedInput, model_dir: Path, output: OutputDir,
             previous: dict | None, fp: dict, model_stats: dict, on_dispatch: Callable | None) -> int:
    output.prepare()
    committed = output.committed()
    output.clean_orphans(set(committed))
    record = {
        "status": "running", "fingerprint": fp, "config": asdict(job), "plan": plan.summary(),
        "model_dir": str(model_dir), "model_file_stats": model_stats, "versions": _versions(),
        "runs": [*(previous or {}).get("runs", []), {"started_at": time.time(), "resumed_shards": len(committed)}],
    }
    output.write_job(record)
    log.info("%s: %d of %d shard(s) already committed", output.root,
             sum(s.shard_id in committed for s in plan.shards), len(plan.shards))
    _commit_plan_errors(plan, output, set(committed))
    pending = [s for s in plan.shards if s.shard_id not in committed]
    done_rows = sum(s.num_rows for s in plan.shards if s.shard_id in committed)
    progress = Progress(plan.num_valid, done_rows, job.executor.progress_interval_s)
    ctx = WorkerContext(str(model_dir), str(output.root), loaded.files, loaded.id_kind,
                        _passthrough_types(job, loaded))
    del loaded  # the frames are the job's largest objects; workers re-read what they need

    def on_force(code: int) -> None:
        output.write_job({**record, "status": "interrupted", "exit_code": code})

    with StopFlag(job.executor.grace_period_s, on_force) as stop:
        result = _dispatch(job, ctx, pending, stop, progress, on_dispatch)
    progress.close()
    if result.interrupted or (stop.requested and len(result.done) < len(pending)):
        output.write_job({**record, "status": "interrupted", "exit_code": stop.exit_code})
        log.warning("interrupted: %d shard(s) committed this run, %d left; rerun the same command to resume",
                    len(result.done), len(pending) - len(result.done))
        return stop.exit_code
    if result.failed:
        output.write_job({**record, "status": "failed", "failed_shards": result.failed})
        raise ShardFailedError(f"{len(result.failed)} shard(s) failed {job.executor.max_attempts} time(s): "
                               + "; ".join(f"{k}: {v}" for k, v in sorted(result.failed.items())[:5])
                               + ". Rerun the same command to retry them (committed shards are kept).")
    totals = _verify(plan, output)
    output.drop_attempts_dir()
    if job.output.report:
        from flashx_batch.report import write_report

        write_report(output.root, totals, plan)
    output.write_job({**record, "status": "succeeded", "totals": totals, "finished_at": time.time()})
    write_atomic(output.root / SUCCESS, _json(totals))
    log.info("done: %d generated, %d error rows, %d output tokens -> %s", totals["generated_rows"],
             totals["error_rows"], totals["output_tokens"], output.root)
    return EXIT_OK


def _dispatch(job: JobConfig, ctx: WorkerContext, pending: list, stop: StopFlag, progress: Progress,
              on_dispatch: Callable | None) -> ExecResult:
    if job.executor.kind == "local":
        return run_local(job, ctx, pending, stop, progress)
    from flashx_batch.runner.ray_executor import RayExecutor  # Ray is imported only when used

    return RayExecutor(job, ctx, on_dispatch).run(pending, stop, progress)


def _commit_plan_errors(plan: Plan, output: OutputDir, committed: set[str]) -> None:
    """Rows rejected while planning go through the same commit protocol as generated ones."""
    for spec in plan.error_shards:
        if spec.shard_id in committed:
            continue
        rows = plan.row_errors[spec.shard_id]
        table = errors_table([r.id for r in rows], plan.id_kind, [r.code for r in rows], [r.message for r in rows],
                             [r.stage for r in rows])
        output.commit(spec.shard_id, 1, {"errors": table}, {"kind": "invalid", "rows": 0, "rows_failed": len(rows),
                                                            "worker": "driver"})


def _verify(plan: Plan, output: OutputDir) -> dict[str, Any]:
    """Check the invariant over committed shards; returns the job totals for _SUCCESS and the report."""
    committed = output.committed()
    expected = {s.shard_id for s in plan.shards + plan.error_shards}
    if set(committed) != expected:
        missing, extra = sorted(expected - set(committed)), sorted(set(committed) - expected)
        raise InvariantError(f"committed shards differ from the plan: missing {missing[:5]}, unexpected {extra[:5]}")
    gen = output.read_ids("generations", expected)
    err = output.read_ids("errors", expected)
    seen = gen + err
    want = Counter(plan.ids)
    if seen != want:
        dup = [i for i, n in seen.items() if n > 1][:5]
        lost = [i for i in want if i not in seen][:5]
        raise InvariantError(f"output ids differ from input ids: duplicated {dup}, missing {lost}")
    stats = output.read_stats()
    sums = {c: (sum(stats.column(c).to_pylist()) if stats is not None else 0)
            for c in ("input_tokens", "output_tokens", "wall_s")}
    error_codes = Counter()
    for s in plan.error_shards:
        error_codes.update(r.code for r in plan.row_errors[s.shard_id])
    return {"input_rows": plan.num_rows, "generated_rows": sum(gen.values()), "error_rows": sum(err.values()),
            "error_counts": dict(error_codes), "shards": len(plan.shards), "error_shards": len(plan.error_shards),
            "input_tokens": sums["input_tokens"], "output_tokens": sums["output_tokens"],
            "shard_wall_s": sums["wall_s"], "padding_efficiency_bucketed": plan.padding_bucketed,
            "padding_efficiency_unbucketed": plan.padding_unbucketed, "finished_at": time.time()}


def _passthrough_types(job: JobConfig, loaded: LoadedInput) -> dict[str, Any]:
    import pyarrow as pa

    types = {}
    for c in job.data.passthrough_columns:
        for fr in loaded.frames:
            t = fr.types[c] if fr.types[c] is not None else pa.array(fr.columns[c]).type
            if not pa.types.is_null(t):
                types[c] = t
                break
    return types


def _versions() -> dict[str, str]:
    import pyarrow
    import torch

    return {"flashx_batch": flashx_batch.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "pyarrow": pyarrow.__version__}


def _json(value: dict) -> str:
    import json

    return json.dumps(value, indent=2, default=str) + "\n"
