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
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from flashx_batch import storage
from flashx_batch.backends import resolved_run
from flashx_batch.config import JobConfig, adapter_dirs, resolve_data_path, resolve_model_dir, validate, validate_eval
from flashx_batch.data import openai_batch
from flashx_batch.data.plan import Plan, format_plan
from flashx_batch.data.preflight import load_inputs
from flashx_batch.data.readers import resolve_inputs
from flashx_batch.data.row_sampling import job_constraint
from flashx_batch.data.validate import RowProblem, check_tools
from flashx_batch.errors import ConfigError, FlashxError, ModelLoadError
from flashx_batch.job_errors import FingerprintMismatchError, LockHeldError
from flashx_batch.runner import faults, fingerprint, openai_output, pieces
from flashx_batch.runner.job_run import EXIT_OK, JobRun, PlannedJob, write_openai_output
from flashx_batch.runner.layout import TornJobJsonError
from flashx_batch.runner.outputs import Output, check_output_location, open_output, output_root
from flashx_batch.runner.signals import Interrupted, StopFlag
from flashx_batch.tasks import get_task, read_columns
from flashx_batch.tasks.generate import chat_format
from flashx_batch.tasks.tables import reserved_column_problem

log = logging.getLogger(__name__)
EXIT_FAILED, EXIT_BAD_JOB, EXIT_TEMPFAIL = 1, 2, 75
# OSErrors that are the machine's state, not a bug: reported in one line, not a traceback
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


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


def plan_job(job: JobConfig) -> PlannedJob:
    """Validate the config, check the model and the input, and build the shard plan (writes nothing)."""
    validate(job)
    task = get_task(job.task)
    storage.configure(job.storage.settings())
    faults.load(job.executor.faults, quiet=True)  # a malformed fault spec: a bad job (exit 2) before anything runs
    check_output_location(job.output.dir)
    if job.data.format == "openai_batch":  # the data keys point at the columns its requests read as
        files = resolve_inputs(resolve_data_path(job.data.path), "openai_batch")
        job = openai_batch.derive(job, openai_batch.endpoint_of([f.path for f in files]))
    asked = list(job.data.passthrough_columns)
    problem = reserved_column_problem(asked + [c for c in job.data.passthrough_if_present if c not in asked],
                                      task.result_columns())
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
        adapter_digests = preflight_model(job, model_dir)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    try:
        tokenizer = Tokenizer(model_dir)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # a tokenizer.json the tokenizers library cannot parse, say
        raise ConfigError(f"model.path={job.model.path}: cannot load the tokenizer: {type(exc).__name__}: {exc}") \
            from None
    check_job_constraint(job, tokenizer)
    if job.data.messages_column and not tokenizer.chat_template:
        raise ConfigError(f"data.messages_column={job.data.messages_column} needs a chat template, and "
                          f"{model_dir} has none.")
    if job.task == "score" and job.score.format == "chat" and not tokenizer.chat_template:
        raise ConfigError(f"score.format=chat renders each pair with the model's chat template, and {model_dir} has "
                          "none; use score.format=separator.")
    data_path = resolve_data_path(job.data.path)
    out = output_root(job.output.dir)
    if _reads_outputs_of(data_path, out):
        raise ConfigError(f"output.dir={job.output.dir} is inside data.path={job.data.path}: every rerun would read "
                          "the job's own outputs as input. Put output.dir outside the input.")
    loaded = load_inputs(job.data, data_path, refuse_under=out if isinstance(out, Path) else None,
                         roles=read_columns(job), text_col=task.text_column(job.data))
    # the passthrough columns as found, and the task's natural metric where eval.metric is unset (a
    # multiple-choice job with answers reports its accuracy): the workers and the fingerprint read these
    job = replace(job, data=replace(job.data, passthrough_columns=loaded.passthrough))
    natural = task.natural_metric(job) if job.eval.metric is None else None
    if natural:
        job = replace(job, eval=replace(job.eval, metric=natural))
        validate_eval(job)
    fmt = chat_format(job, tokenizer) if task.generates else None
    answers = f"reasoning={fmt.reasoning},tool_calls={fmt.tool_calls}" if fmt is not None and fmt.parses else None
    return PlannedJob(job, model_dir, loaded, task.plan(job, loaded, tokenizer), metric_from_task=bool(natural),
                      answer_format=answers, adapter_digests=adapter_digests)


def check_job_constraint(job: JobConfig, tokenizer) -> None:
    """A job-wide constraint the grammar library cannot compile for this model stops the job (exit 2)
    before any output; per-row ones become bad_constraint rows while planning."""
    constraint = job_constraint(job.sampling)
    if constraint is None:
        return
    from flashx_batch.runtime.grammar import compile_check

    problem = compile_check(tokenizer)(constraint)
    if problem is not None:
        raise ConfigError(f"sampling.{constraint.kind} cannot be compiled: {problem}. Fix it, or give it per row "
                          f"(sampling.from_columns) so that only those rows fail.")


def preflight_model(job: JobConfig, model_dir: Path) -> dict[str, str]:
    """What an engine would refuse at load, found without loading it: the checkpoint (architecture,
    weight headers against config.json), the LoRA adapters against it, and the engine's own option
    checks, with the backend where this process runs it (the local executor; Ray jobs probe the backend
    on a worker instead). Returns each adapter's content digest (for the fingerprint)."""
    from flashx_batch.backends import check_known, get_backend
    from flashx_batch.models.loader import check_checkpoint
    from flashx_batch.models.peft_adapter import check_adapter
    from flashx_batch.runtime.engine import check_options
    from flashx_batch.runtime.inputs import check_lora_options

    cfg = check_checkpoint(model_dir)
    if cfg.classifier is not None and job.task not in ("classify", "score", "embed"):
        raise ConfigError(f"model.path={job.model.path} is a sequence classifier (a score head, no LM head) and "
                          f"task={job.task} needs a language model: use task=classify or score (or task=embed).")
    if job.task == "score" and (cfg.classifier is None or cfg.classifier.num_labels != 1):
        what = f"{cfg.classifier.num_labels} labels" if cfg.classifier is not None else cfg.architecture
        raise ConfigError(f"task=score needs a one-label sequence classifier (a reranker or reward model), and "
                          f"model.path={job.model.path} is {what}; use task=classify for a classifier's labels.")
    if job.task == "embed":  # the checkpoint's own head (UnsupportedPooling: exit 2) and its vectors' width
        from flashx_batch.runtime.checkpoint_pooling import checkpoint_pooling

        head = checkpoint_pooling(model_dir)
        width, dims = head.width(cfg.hidden_size) if head else cfg.hidden_size, job.embed.dimensions
        if dims is not None and dims > width:
            raise ConfigError(f"embed.dimensions={dims}: {job.model.path}'s vectors have {width} components; give "
                              f"1..{width} (or null for all).")
    if cfg.classifier is None and job.task == "classify":
        raise ConfigError(f"task=classify needs a sequence classifier (*ForSequenceClassification), and "
                          f"model.path={job.model.path} is {cfg.architecture}.")
    options = job.engine_options()
    check_known(options.backend)
    local = job.executor.kind == "local" and options.backend != "onnx"
    check_options(options, cfg, get_backend(options.backend) if local else None)
    if not job.model.lora_adapters:
        return {}
    check_lora_options(options, cfg)
    return {name: check_adapter(name, path, cfg).digest for name, path in adapter_dirs(job).items()}


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
    job, model_dir, plan = planned.job, planned.model_dir, planned.plan
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
        if planned.metric_from_task and previous is not None and \
                "eval.metric" not in previous.get("fingerprint", {}):  # a job started before tasks had a default
            planned = replace(planned, job=replace(job, eval=replace(job.eval, metric=None)), metric_from_task=False)
            job = planned.job
            log.info("%s: resumed without the task's default metric, as the job was started", output.root)
        model_stats = fingerprint.model_file_stats(model_dir, (previous or {}).get("model_file_stats"))
        fp = fingerprint.compute(job, plan, model_stats, resolved_as, planned.answer_format, planned.adapter_digests)
        differences = fingerprint.diff(previous.get("fingerprint", {}), fp) if previous is not None else []
        # a job finished under earlier row rules is still finished: nothing to rerun, nothing rewritten
        rules_only = all(d.startswith(fingerprint.ROW_RULES_KEY + ":") for d in differences)
        if previous is not None and rules_only and _already_done(previous, committed, plan, output):
            log.info("%s: already done (_SUCCESS); nothing to run, nothing rewritten", output.root)
            if job.output.format == "openai_batch" and not output.has_file(openai_output.FILE_NAME):
                write_openai_output(job, output, committed, model_dir)  # asked for after the job finished
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
        return JobRun(planned, output, fp, model_stats, previous, stop, on_dispatch).execute()


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
