"""`run(JobConfig) -> exit code`: one batch job from preflight to `_SUCCESS`.

Who calls it: `flashx_batch.cli` (once per Hydra run, multirun included), `jobs/*.py` and tests.
Steps: plan (read, check, tokenize, shard) → dry run stops here → open the output directory
(fingerprint check, lock, clean orphans) → commit plan-time error rows → execute pending shards →
verify the invariant → report → `_SUCCESS`. Every run, however it ends, records its row accounting
(in = generated + errors + pending) in job.json. Exit codes (DESIGN.md): 0 done, 2 bad job (nothing
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
from flashx_batch.runner import faults, fingerprint, pieces
from flashx_batch.runner.executor import ExecResult, run_local
from flashx_batch.runner.failures import FailedRows
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
    faults.load(job.executor.faults, quiet=True)  # a malformed fault spec: a bad job (exit 2) before anything runs
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
    # A shard split by an earlier run (poison-row isolation) resumes as its uncommitted pieces only.
    pending = [p for s in plan.shards for p in pieces.uncovered(s, committed)]
    if pending or any(s.shard_id not in committed for s in plan.error_shards):
        (output.root / SUCCESS).unlink(missing_ok=True)  # files removed since it finished: not finished now
    _commit_plan_errors(plan, output, set(committed))
    log.info("%s: %d of %d shard(s) already committed, %d piece(s) to run", output.root,
             sum(not pieces.uncovered(s, committed) for s in plan.shards), len(plan.shards), len(pending))
    progress = Progress(plan.num_valid, plan.num_valid - sum(p.num_rows for p in pending),
                        job.executor.progress_interval_s)
    ctx = WorkerContext(str(model_dir), str(output.root), loaded.files, loaded.id_kind,
                        _passthrough_types(job, loaded), faults=faults.load(job.executor.faults))
    del loaded  # the frames are the job's largest objects; workers re-read what they need

    def on_force(code: int) -> None:  # the second signal / grace expiry: last words before os._exit
        output.write_job({**record, "status": "interrupted", "exit_code": code,
                          "accounting": accounting(plan, output.committed())})

    with StopFlag(job.executor.grace_period_s, on_force) as stop:
        result = _dispatch(job, ctx, pending, stop, progress, on_dispatch, FailedRows(output, plan.ref_ids,
                                                                                       plan.id_kind))
    progress.close()
    committed = output.committed()
    remaining = [p for s in plan.shards for p in pieces.uncovered(s, committed)]
    counts = accounting(plan, committed)
    log.info("rows: %(input_rows)d in = %(generated_rows)d generated + %(error_rows)d error rows "
             "+ %(pending_rows)d not yet run", counts)
    if remaining and stop.requested:
        output.write_job({**record, "status": "interrupted", "exit_code": stop.exit_code, "accounting": counts})
        log.warning("interrupted: %d piece(s) committed this run, %d left; rerun the same command to resume",
                    len(result.done), len(remaining))
        return stop.exit_code
    if remaining:
        failed = result.failed or {p.shard_id: "not run" for p in remaining}
        output.write_job({**record, "status": "failed", "failed_shards": failed, "accounting": counts})
        raise ShardFailedError(f"{len(failed)} shard(s) failed {job.executor.max_attempts} time(s): "
                               + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items())[:5])
                               + ". Rerun the same command to retry them (committed shards are kept).")
    totals = _verify(plan, output)
    if job.output.report:
        from flashx_batch.report import write_report

        write_report(output.root, totals, plan)
    output.write_job({**record, "status": "succeeded", "totals": totals, "accounting": accounting(plan, committed),
                      "finished_at": time.time()})
    write_atomic(output.root / SUCCESS, _json(totals))
    log.info("done: %d generated, %d error rows, %d output tokens -> %s", totals["generated_rows"],
             totals["error_rows"], totals["output_tokens"], output.root)
    return EXIT_OK


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
    """Check the invariant shard by shard; remove orphans; returns the job totals for _SUCCESS and the report.

    For every planned shard: its committed pieces do not overlap and cover it, and the ids they hold
    (generations + errors) are exactly the shard's ids, once each. Nothing else may be committed.
    """
    import pyarrow.parquet as pq

    committed = output.committed()
    gen: Counter = Counter()
    err: Counter = Counter()
    codes: Counter = Counter()
    claimed: set[str] = set()
    for spec in plan.shards + plan.error_shards:
        mine = pieces.pieces_of(spec.shard_id, committed)
        clash = [(a, b) for i, a in enumerate(mine) for b in mine[i + 1:] if pieces.overlaps(a, b)]
        if clash or pieces.uncovered(spec, mine):
            raise InvariantError(f"shard {spec.shard_id}: committed pieces {mine} overlap {clash[:3]} or leave rows "
                                 "uncovered")
        seen: Counter = Counter()
        for pid in mine:
            for kind, counter in (("generations", gen), ("errors", err)):
                if kind in committed[pid]["files"]:
                    cols = ["id", "error_code"] if kind == "errors" else ["id"]
                    table = pq.read_table(output.part(kind, pid), columns=cols)
                    ids = table.column("id").to_pylist()
                    counter.update(ids)
                    seen.update(ids)
                    if kind == "errors":
                        codes.update(table.column("error_code").to_pylist())
        want = Counter(plan.ref_ids[r] for r in spec.refs)
        if seen != want:
            raise InvariantError(f"shard {spec.shard_id}: {sum(seen.values())} ids committed for {spec.num_rows} "
                                 f"rows in (duplicated {[i for i, n in seen.items() if n > 1][:5]}, missing "
                                 f"{[i for i in want if i not in seen][:5]})")
        claimed.update(mine)
    if set(committed) - claimed:
        raise InvariantError(f"committed pieces outside the plan: {sorted(set(committed) - claimed)[:5]}")
    if gen + err != Counter(plan.ids):
        raise InvariantError("output ids differ from input ids")  # unreachable when every shard checks out
    output.clean_orphans(set(committed))  # a half-published piece of a shard that was later split
    output.drop_attempts_dir()
    stats = output.read_stats()
    sums = {c: (sum(stats.column(c).to_pylist()) if stats is not None else 0)
            for c in ("input_tokens", "output_tokens", "wall_s")}
    return {"input_rows": plan.num_rows, "generated_rows": sum(gen.values()), "error_rows": sum(err.values()),
            "error_counts": dict(codes), "shards": len(plan.shards), "error_shards": len(plan.error_shards),
            "pieces": len(committed), "input_tokens": sums["input_tokens"], "output_tokens": sums["output_tokens"],
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
