"""ShardWorker: one engine, many shards. Reads a shard's rows, generates, commits.

Who calls it: the local executor (in the driver process) and the Ray executor (wrapped as an actor,
one per accelerator). The engine is built once in `__init__`; `run_shard` gets only a `ShardSpec`
(row references) and re-reads the rows from the input files, so rows never travel through Ray.
The worker commits its own shard (`OutputDir.commit`, or `ObjectOutputDir.commit` on an object
store): results never travel back either, only a small summary dict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from flashx_batch import storage
from flashx_batch.config import JobConfig
from flashx_batch.data.plan import ShardSpec
from flashx_batch.data.preflight import data_columns, text_column
from flashx_batch.data.readers import Frame, InputFile, read_frame, read_rows
from flashx_batch.data.row_sampling import row_params
from flashx_batch.data.validate import RowProblem, build_prompt, encode_score_rows, row_tools, score_row
from flashx_batch.errors import ConfigError
from flashx_batch.evaluation.metrics import check_metric
from flashx_batch.evaluation.metrics import score_row as metric_score
from flashx_batch.job_errors import FatalEngineError
from flashx_batch.runner.failures import FATAL, WorkerFailure, kind_of
from flashx_batch.runner.outputs import open_output
from flashx_batch.runner.tables import generations_table, sample_columns, score_column, score_table, stats_table

if TYPE_CHECKING:
    from flashx_batch.backends.distributed import RankSpec
    from flashx_batch.runner.faults import Faults

log = logging.getLogger(__name__)
_FRAME_CACHE = 2  # shards of one bucket usually come from the same few files


@dataclass
class WorkerContext:
    """What every worker needs besides the job config; small and picklable (it goes to each actor)."""

    model_dir: str
    output_dir: str
    files: list[InputFile]
    id_kind: str
    passthrough_types: dict[str, pa.DataType] = field(default_factory=dict)
    num_threads: int | None = None
    faults: Faults | None = None  # armed fault hooks (tests only); None in production
    job_digest: str | None = None  # the job's fingerprint digest, stamped on every manifest committed
    model_files: dict[str, list] = field(default_factory=dict)  # name -> [size, mtime_ns, sha256] as fingerprinted
    resolved: str | None = None  # backend/dtype the fingerprint holds (`backends.resolved_run`); None: unchecked


def _check_reserved_accelerator(engine: Any, backend: str, name: str) -> None:
    """A Ray actor that reserved an accelerator runs on it: an engine that ended up on the CPU instead
    (`runtime.backend=auto` finding no usable device: a torch without CUDA, a missing torch_npu) is a
    bad job (exit 2), never a silent CPU run on a device-priced actor."""
    from flashx_batch.backends import ray_accelerator_ids

    reserved = {k: list(v) for k, v in (ray_accelerator_ids() or {}).items() if v}
    # ONNX Runtime drives its device itself (its engine's torch device is the host's): not this check's
    if reserved and engine.backend.name == "cpu":
        raise ConfigError(f"{name}: Ray gave this actor {reserved}, but runtime.backend={backend} resolved to the CPU "
                          "here (torch cannot use that device on this node); install the device's torch build on "
                          "the node (`python -m flashx_batch.doctor` there says what is missing), or set "
                          "runtime.backend=cpu to run on CPUs on purpose.")


def _check_resolved(engine: Any, expected: str | None, name: str) -> None:
    """This engine runs the backend and dtype the job's fingerprint holds: one that resolved `auto`
    otherwise (a node with another device, a resume on another machine) would mix precisions in one
    output, so it is a bad job (exit 2) before it runs a row."""
    here = f"{engine.backend.name}/{str(engine.dtype).removeprefix('torch.')}"
    if expected is not None and here != expected:
        raise ConfigError(f"{name}: this engine runs as {here}, and the job's rows so far were computed as {expected} "
                          "(runtime.backend / model.dtype `auto` resolved differently here); set runtime.backend and "
                          "model.dtype explicitly, or run the job into a new output.dir.")


def _actor_logging(level: str) -> None:
    """The package's log records at the job's level on this actor's stderr, which Ray forwards to the
    driver (prefixed with the actor's name and pid); once per process."""
    package = logging.getLogger("flashx_batch")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package.addHandler(handler)
        package.setLevel(getattr(logging, level.upper(), logging.INFO))
        package.propagate = False


def row_seed(job_seed: int, row_id: Any) -> int:
    """A row's sampling seed: a stable hash of (job seed, row id), so sharding never changes samples."""
    digest = hashlib.sha256(f"{job_seed}\x1f{row_id!r}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class ShardWorker:
    def __init__(self, job: JobConfig, ctx: WorkerContext, name: str = "local", defer_errors: bool = False,
                 replica_rank: int | None = None) -> None:
        """Load the engine. `defer_errors` (Ray actors): a load failure is kept as `boot_failure` and
        reported by `ready()` as data, instead of dying in the constructor, where Ray would keep only
        its own header line of the cause. `replica_rank`: this actor is that rank of a tensor-parallel
        replica (`runner.replicas`); the engine loads later, in `join_replica`, once the ranks know where
        to meet."""
        self.job, self.ctx, self.name = job, ctx, name
        if defer_errors:  # a Ray actor: its log lines (engine ready, kernels compiled) reach the driver's log
            _actor_logging(job.log_level)
        storage.configure(job.storage.settings())  # input and output URIs open with the job's storage.* keys
        self.node = socket.gethostname()
        self.boot_failure: WorkerFailure | None = None
        self.replica_rank, self.rendezvous = replica_rank, None
        if replica_rank is None:
            self._load_deferring(defer_errors)
        self.out = open_output(ctx.output_dir, ctx.faults, ctx.job_digest)
        self.faults = ctx.faults
        self.dead: str | None = None  # set by a fatal engine error: this engine never runs again
        self._frames: OrderedDict[int, Frame] = OrderedDict()  # whole files (JSONL, CSV, Arrow), the last two
        self._last_rows: tuple[str, list] | None = None
        self._columns = data_columns(job.data, job.task, job.extra_columns())
        self._pattern = check_metric(job.eval.metric, job.eval.regex) if job.eval.metric else None
        self._text_column = text_column(job.data, job.task)

    def _load_deferring(self, defer_errors: bool) -> None:
        try:
            self._load()
        except Exception as exc:
            if not defer_errors:
                raise
            self.boot_failure = WorkerFailure.from_exception(exc, node=self.node, worker=self.name,
                                                             shard_id="(engine load)")

    def _load(self) -> None:
        from flashx_batch.runner.fingerprint import check_model_unchanged
        from flashx_batch.runtime.engine import Engine  # deferred: the driver plans without loading torch models

        options = self.job.engine_options(self.ctx.num_threads)
        check_model_unchanged(Path(self.ctx.model_dir), self.ctx.model_files)
        self.engine = Engine(Path(self.ctx.model_dir), options, rendezvous=self.rendezvous)
        _check_reserved_accelerator(self.engine, self.job.runtime.backend, self.name)
        _check_resolved(self.engine, self.ctx.resolved, self.name)
        check_model_unchanged(Path(self.ctx.model_dir), self.ctx.model_files)  # not replaced while it loaded
        if self.engine.tokenizer is None:
            raise RuntimeError(f"{self.ctx.model_dir}: no tokenizer.json; text prompts cannot be tokenized")

    # ---- a rank of a tensor-parallel replica (Ray; `runner.replicas` calls these in order) -------
    def host_rendezvous(self, size: int) -> RankSpec:
        """Rank 0: open the replica's rendezvous on this node; the other ranks join it at the spec returned."""
        import ray

        from flashx_batch.backends.distributed import Rendezvous

        self.rendezvous = Rendezvous.host(size, bind=ray.util.get_node_ip_address())
        return self.rendezvous.spec

    def join_replica(self, spec: RankSpec | None) -> dict[str, Any]:
        """Load this rank's engine, meeting the other ranks at `spec` (rank 0: None, its own rendezvous);
        returns `ready()`'s answer. A failure is kept as `boot_failure` (the other ranks learn of it in
        the engine's start-up, rank 0 reports it)."""
        from flashx_batch.backends.distributed import Rendezvous

        try:
            if spec is not None:
                self.rendezvous = Rendezvous.join(dataclasses.replace(spec, rank=self.replica_rank))
            elif self.rendezvous is None:  # rank 0 whose `host_rendezvous` failed: never spawn ranks of our own
                raise RuntimeError(f"{self.name}: rank 0 has no rendezvous (host_rendezvous failed)")
        except Exception as exc:
            self.boot_failure = WorkerFailure.from_exception(exc, node=self.node, worker=self.name,
                                                             shard_id="(engine load)")
            return self.ready()
        self._load_deferring(True)
        return self.ready()

    def follow(self) -> str:
        """A follower rank's life: replay rank 0's engine calls until it says stop; returns why it ended
        (the Ray executor watches this call: its end, or this actor's death, ends the replica)."""
        from flashx_batch.backends.distributed import ReplicaBroken
        from flashx_batch.runtime.tensor_parallel import follow

        if self.boot_failure is not None:
            return f"not loaded: {self.boot_failure.line}"
        if getattr(self, "engine", None) is None:  # join_replica never ran (rank 0's rendezvous failed)
            return "not loaded: this rank never joined its replica"
        try:
            follow(self.engine.runner, self.engine.replica.comm)
        except ReplicaBroken as exc:
            return f"replica broken: {exc}"
        return "stopped"

    def close(self) -> None:
        """Release the engine's other ranks (a tensor-parallel replica started here); nothing otherwise."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def _peers(self) -> tuple[int, ...]:
        replica = getattr(getattr(self, "engine", None), "replica", None)
        return replica.rendezvous.peer_pids() if replica is not None and replica.rank == 0 else ()

    def ready(self) -> dict[str, Any]:
        """Cheap call the Ray executor awaits to know the engine loaded (and where), or why it did not
        (`failure`: a WorkerFailure as a dict)."""
        if self.boot_failure is not None:
            return {"name": self.name, "failure": self.boot_failure.as_dict(), "pid": os.getpid()}
        return {"name": self.name, "device": str(self.engine.device), "pid": os.getpid()}

    def run_shard(self, spec: ShardSpec, attempt: int) -> dict[str, Any]:
        """Generate and commit one shard (or piece of one); returns its summary (committed=False if
        another attempt won), or `{"failure": WorkerFailure dict}` when the try failed: errors travel
        as data, with their real type, message and frames. On failure the attempt's staging
        directory is removed first; a fatal engine error also retires this worker (`dead`): every
        later call fails at once, and the executors replace it rather than retry on it."""
        try:
            if self.boot_failure is not None:
                raise FatalEngineError(f"{self.name}: the engine did not load ({self.boot_failure.line})")
            if self.dead is not None:
                raise FatalEngineError(f"{self.name}: the engine failed earlier ({self.dead}); replace this worker")
            staging = self.out.start_attempt(spec.shard_id, attempt)  # visible while the shard runs
        except Exception as exc:
            return self._failed(exc, spec, attempt)
        try:
            return self._run(spec, attempt, staging)
        except BaseException as exc:
            self.out.discard(staging)  # a full disk gets its space back at once
            if not isinstance(exc, Exception):
                raise
            if kind_of(exc) == FATAL:
                self.dead = f"{type(exc).__name__}: {exc}"
            return self._failed(exc, spec, attempt)

    def _failed(self, exc: Exception, spec: ShardSpec, attempt: int) -> dict[str, Any]:
        failure = WorkerFailure.from_exception(exc, node=self.node, worker=self.name, shard_id=spec.shard_id,
                                               attempt=attempt)
        return {"shard_id": spec.shard_id, "attempt": attempt, "worker": self.name, "failure": failure.as_dict()}

    def _run(self, spec: ShardSpec, attempt: int, staging: Path) -> dict[str, Any]:
        if self.job.task != "generate":
            return self._run_scoring(spec, attempt, staging)
        started = time.perf_counter()
        job = self.job
        ids, texts, passthrough, params = self._rows(spec)
        if self.faults is not None:
            self.faults.fire("before_generate", spec.shard_id, attempt, ids, peers=self._peers())
        # chat rows are template-rendered text that already carries BOS / role tokens
        token_lists = self.engine.tokenizer.encode_batch(texts, add_special_tokens=not job.data.messages_column)
        outs = self.engine.generate(token_lists, params)  # sampling.n > 1: n outputs per row, in row order
        if self.faults is not None:
            self.faults.fire("after_generate", spec.shard_id, attempt, ids)
        g = self.engine.last_stats
        wall = time.perf_counter() - started
        of_row = pa.array([o.index for o in outs], pa.int64())
        logprobs = bool(job.sampling.logprobs)
        samples = sample_columns([o.sample_index for o in outs] if job.sampling.n > 1 else None,
                                 [o.token_ids for o in outs] if logprobs else None,
                                 [o.logprobs for o in outs] if logprobs else None,
                                 [o.top_logprobs for o in outs] if logprobs else None)
        if job.eval.metric:  # each output scored against its row's reference (null reference: unscored)
            refs = self._references(spec)
            samples.update(score_column([metric_score(job.eval.metric, o.text, refs[o.index], self._pattern)
                                         for o in outs]))
        gen = generations_table([ids[o.index] for o in outs], self.ctx.id_kind, [o.text or "" for o in outs],
                                [o.finish_reason for o in outs], [o.num_input_tokens for o in outs],
                                [o.num_generated_tokens for o in outs], spec.shard_id,
                                {c: a.take(of_row) for c, a in passthrough.items()}, samples)
        stats = stats_table({
            "shard_id": spec.shard_id, "bucket_min_len": spec.bucket_min_len, "bucket_max_len": spec.bucket_max_len,
            "rows": len(ids), "rows_failed": 0, "input_tokens": g.input_tokens, "output_tokens": g.output_tokens,
            "padding_efficiency": g.padding_efficiency, "prefill_s": g.prefill_s, "decode_s": g.decode_s,
            "wall_s": wall, "output_tok_per_s": g.output_tokens / wall if wall else 0.0,
            "total_tok_per_s": (g.input_tokens + g.output_tokens) / wall if wall else 0.0,
            "kv_bytes_peak": g.kv_bytes_peak, "cache_policy": job.runtime.cache_policy,
            # the most rows decoding at once: more than max_batch_size under segment_sparse and batch growth
            "batch_size": max(self.engine.admitted_batch_size, g.peak_rows),
            "device": str(self.engine.device), "attempt": attempt,
            "batches": g.batches, "kv_bytes_arena": g.kv_bytes_arena, "kv_bytes_static_peak": g.kv_bytes_static_peak,
            "cached_prompt_tokens": g.cached_prompt_tokens, "prefill_tokens_computed": g.prefill_tokens_computed,
            "prefix_hit_rate": g.cached_prompt_tokens / g.input_tokens if g.input_tokens else 0.0,
            "host": socket.gethostname(),
            "worker": self.name, "finished_at": time.time(),
        })
        won = self.out.commit(spec.shard_id, attempt, {"generations": gen, "stats": stats},
                              {"kind": spec.kind, "rows": len(ids), "rows_failed": 0, "worker": self.name},
                              staging)
        log.debug("shard %s: %d rows, %d output tokens, %.2fs (%s)", spec.shard_id, len(ids), g.output_tokens, wall,
                  "committed" if won else "already committed")
        return {"shard_id": spec.shard_id, "rows": len(ids), "output_tokens": g.output_tokens, "wall_s": wall,
                "committed": won, "attempt": attempt, "worker": self.name}

    def _run_scoring(self, spec: ShardSpec, attempt: int, staging: Path) -> dict[str, Any]:
        """A shard of a scoring task: rows checked and encoded as the plan did, scored by the engine's
        log-likelihood scorer, committed to generations/ (columns: tables.SCORE_COLUMNS[task])."""
        started = time.perf_counter()
        job, task, lm = self.job, self.job.task, self.engine.lm
        ids, rows, extra = [], [], {c: [] for c in job.data.passthrough_columns}
        for fi, ri, fr, k in self._shard_rows(spec):
            row = score_row(task, job.data, fr.columns, k)
            if isinstance(row, RowProblem):  # the plan accepted this row: the input changed since
                raise RuntimeError(f"{self.ctx.files[fi].path} row {ri}: {row.message}; the input changed after "
                                   "planning")
            ids.append(fr.columns[job.data.id_column][k])
            rows.append(row)
            for c in extra:
                extra[c].append(fr.columns[c][k])
        passthrough = {c: pa.array(v, self.ctx.passthrough_types.get(c)) for c, v in extra.items()}
        encoded = encode_score_rows(task, rows, lm.encoder, lm.max_length, job.data.target_delimiter,
                                    job.runtime.long_input)
        bad = next((e for e in encoded if isinstance(e, RowProblem)), None)
        if bad is not None:
            raise RuntimeError(f"shard {spec.shard_id}: {bad.message}; the input or tokenizer changed after planning")
        if self.faults is not None:
            self.faults.fire("before_generate", spec.shard_id, attempt, ids, peers=self._peers())
        values: dict[str, list[Any]] = {}
        if task == "loglikelihood":
            logprobs, greedy = lm.score_pairs([e.pairs[0] for e in encoded])
            values = {"logprob": logprobs, "num_tokens": [len(e.pairs[0][1]) for e in encoded], "is_greedy": greedy,
                      "truncated": [e.truncated for e in encoded]}
        elif task == "perplexity":
            logprobs = lm.score_rolling([list(e.tokens) for e in encoded])
            counts = [len(e.tokens) for e in encoded]
            values = {"logprob": logprobs, "num_tokens": counts,
                      "perplexity": [math.exp(-lp / n) if -lp / n < 700 else math.inf
                                     for lp, n in zip(logprobs, counts, strict=True)]}
        else:
            scored = lm.score_choices([list(e.pairs) for e in encoded])
            raw = [lps for lps, _ in scored]
            norm = [[lp / len(c) for lp, c in zip(lps, r.choices, strict=True)]
                    for lps, r in zip(raw, rows, strict=True)]
            pred = [_first_max(v) for v in raw]
            values = {"choice_logprobs": raw, "choice_logprobs_norm": norm, "pred": pred,
                      "pred_norm": [_first_max(v) for v in norm],
                      "correct": [None if r.answer is None else p == r.answer for p, r in zip(pred, rows, strict=True)],
                      "truncated": [e.truncated for e in encoded]}
        if self.faults is not None:
            self.faults.fire("after_generate", spec.shard_id, attempt, ids)
        wall = time.perf_counter() - started
        tokens = sum(e.length for e in encoded)
        if job.eval.metric == "choice_accuracy":
            passthrough = {**score_column([None if c is None else float(c) for c in values["correct"]]),
                           **passthrough}
        table = score_table(task, ids, self.ctx.id_kind, values, spec.shard_id, passthrough)
        stats = stats_table({
            "shard_id": spec.shard_id, "bucket_min_len": spec.bucket_min_len, "bucket_max_len": spec.bucket_max_len,
            "rows": len(ids), "rows_failed": 0, "input_tokens": tokens, "output_tokens": 0,
            "padding_efficiency": 1.0, "prefill_s": wall, "decode_s": 0.0, "wall_s": wall, "output_tok_per_s": 0.0,
            "total_tok_per_s": tokens / wall if wall else 0.0, "kv_bytes_peak": 0,
            "cache_policy": job.runtime.cache_policy, "batch_size": lm.max_rows, "device": str(self.engine.device),
            "attempt": attempt, "task": task, "host": socket.gethostname(), "worker": self.name,
            "finished_at": time.time(),
        })
        won = self.out.commit(spec.shard_id, attempt, {"generations": table, "stats": stats},
                              {"kind": spec.kind, "rows": len(ids), "rows_failed": 0, "worker": self.name}, staging)
        return {"shard_id": spec.shard_id, "rows": len(ids), "output_tokens": 0, "wall_s": wall,
                "committed": won, "attempt": attempt, "worker": self.name}

    def _rows(self, spec: ShardSpec) -> tuple[list[Any], list[str], dict[str, pa.Array], list]:
        """The shard's ids, prompt texts, passthrough columns and sampling parameters, as planned."""
        data, s = self.job.data, self.job.sampling
        text_col = self._text_column
        ids, texts, params = [], [], []
        extra: dict[str, list[Any]] = {c: [] for c in data.passthrough_columns}
        for fi, ri, fr, k in self._shard_rows(spec):
            value = fr.columns[text_col][k]
            text = build_prompt(value, value, bool(data.messages_column), data.prompt_prefix, data.max_row_bytes,
                                self.engine.tokenizer, row_tools(data, fr.columns, k), data.chat_template_kwargs)
            if isinstance(text, RowProblem):  # the plan accepted this row: the input changed since
                raise RuntimeError(f"{self.ctx.files[fi].path} row {ri}: {text.message}; the input changed "
                                   "after planning")
            row_id = fr.columns[data.id_column][k]
            p = row_params(s, fr.columns, k, row_seed(s.seed, row_id), self.job.runtime.max_output_len)
            if isinstance(p, RowProblem):
                raise RuntimeError(f"{self.ctx.files[fi].path} row {ri}: {p.message}; the input changed after "
                                   "planning")
            ids.append(row_id)
            texts.append(text)
            params.append(p)
            for c in extra:
                extra[c].append(fr.columns[c][k])
        arrays = {c: pa.array(v, self.ctx.passthrough_types.get(c)) for c, v in extra.items()}
        return ids, texts, arrays, params

    def _references(self, spec: ShardSpec) -> list[Any]:
        """The shard's reference answers (`eval.reference_column`), in row order."""
        column = self.job.eval.reference_column
        return [fr.columns[column][k] for _, _, fr, k in self._shard_rows(spec)]

    def _shard_rows(self, spec: ShardSpec) -> list[tuple[int, int, Frame, int]]:
        """(file index, row index, frame, the row's position in the frame) for each row of the shard,
        in order. Parquet rows are read by row group (`read_rows`: a 16-row shard reads one group, not
        the file); other formats from the whole file, parsed once and cached. The shard's rows are
        kept until the next shard (its references are read after its prompts)."""
        if self._last_rows is not None and self._last_rows[0] == spec.shard_id:
            return self._last_rows[1]
        by_file: dict[int, list[int]] = {}
        for fi, ri in spec.refs:
            by_file.setdefault(fi, []).append(ri)
        frames: dict[int, tuple[Frame, dict[int, int] | None]] = {}
        for fi, rows in by_file.items():
            file = self.ctx.files[fi]
            frames[fi] = read_rows(file, self._columns, rows) if file.format == "parquet" else (self._frame(fi), None)
        out = []
        for fi, ri in spec.refs:
            fr, position = frames[fi]
            out.append((fi, ri, fr, ri if position is None else position[ri]))
        self._last_rows = (spec.shard_id, out)
        return out

    def _frame(self, fi: int) -> Frame:
        if fi in self._frames:
            self._frames.move_to_end(fi)
            return self._frames[fi]
        frame = read_frame(self.ctx.files[fi], self._columns, self._text_column)
        self._frames[fi] = frame
        if len(self._frames) > _FRAME_CACHE:
            self._frames.popitem(last=False)
        return frame


def _first_max(values: list[float]) -> int:
    """Index of the largest value, the first on ties (numpy's argmax, as lm-eval picks)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))
