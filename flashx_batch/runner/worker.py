"""ShardWorker: one engine, many shards. Reads a shard's rows, generates, commits.

Who calls it: the local executor (in the driver process) and the Ray executor (wrapped as an actor,
one per accelerator). The engine is built once in `__init__`; `run_shard` gets only a `ShardSpec`
(row references) and re-reads the rows from the input files, so rows never travel through Ray.
The worker commits its own shard (`OutputDir.commit`, or `ObjectOutputDir.commit` on an object
store): results never travel back either, only a small summary dict.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from flashx_batch import storage
from flashx_batch.config import JobConfig, adapter_dirs
from flashx_batch.data.plan import ShardSpec
from flashx_batch.data.readers import Frame, InputFile, read_frame, read_rows
from flashx_batch.errors import ConfigError
from flashx_batch.evaluation.metrics import check_metric
from flashx_batch.job_errors import FatalEngineError
from flashx_batch.runner.failures import FATAL, WorkerFailure, kind_of
from flashx_batch.runner.outputs import open_output
from flashx_batch.tasks import get_task, read_columns
from flashx_batch.tasks.tables import stats_table

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
    adapter_digests: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> content digest, as planned


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


class ShardWorker:
    def __init__(self, job: JobConfig, ctx: WorkerContext, name: str = "local", defer_errors: bool = False,
                 replica_rank: int | None = None) -> None:
        """Load the engine. `defer_errors` (Ray actors): a load failure is kept as `boot_failure` and
        reported by `ready()` as data, instead of dying in the constructor, where Ray would keep only
        its own header line of the cause. `replica_rank`: this actor is that rank of a tensor-parallel
        replica (`runner.replicas`); the engine loads later, in `join_replica`, once the ranks know where
        to meet."""
        self.job, self.ctx, self.name = job, ctx, name
        self.task = get_task(job.task)
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
        self._columns = list(read_columns(job))
        self.metric_pattern = check_metric(job.eval.metric, job.eval.regex) if job.eval.metric else None
        self._text_column = self.task.text_column(job.data)

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
        self.engine = Engine(Path(self.ctx.model_dir), options, rendezvous=self.rendezvous,
                             lora_adapters=adapter_dirs(self.job))
        if self.engine.adapter_digests != self.ctx.adapter_digests:  # an adapter replaced since the job was planned
            raise ConfigError(f"{self.name}: the LoRA adapters' files differ from the ones the job was planned with "
                              f"({self.ctx.adapter_digests} -> {self.engine.adapter_digests}); restore them, or run "
                              "into a new output.dir.")
        _check_reserved_accelerator(self.engine, self.job.runtime.backend, self.name)
        _check_resolved(self.engine, self.ctx.resolved, self.name)
        check_model_unchanged(Path(self.ctx.model_dir), self.ctx.model_files)  # not replaced while it loaded
        if self.task.generates and self.job.runtime.tensor_parallel_size == 1:
            self.engine.warm_up()  # kernels compile at load (outside the shard watchdog), only the ones it runs
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
        """One shard of any task: its rows read, computed and committed with one stats row; the fault hooks
        fire around the computation (tests)."""
        started = time.perf_counter()
        job = self.job
        rows = self.task.read(self, spec)
        if self.faults is not None:
            self.faults.fire("before_generate", spec.shard_id, attempt, rows.ids, peers=self._peers())
        result = self.task.compute(self, rows, spec)
        if self.faults is not None:
            self.faults.fire("after_generate", spec.shard_id, attempt, rows.ids)
        wall = time.perf_counter() - started
        n_in, n_out = result.input_tokens, result.output_tokens
        stats = stats_table({
            "shard_id": spec.shard_id, "bucket_min_len": spec.bucket_min_len, "bucket_max_len": spec.bucket_max_len,
            "rows": len(rows.ids), "rows_failed": 0, "input_tokens": n_in, "output_tokens": n_out,
            "padding_efficiency": 1.0, "prefill_s": wall, "decode_s": 0.0, "wall_s": wall,
            "output_tok_per_s": n_out / wall if wall else 0.0,
            "total_tok_per_s": (n_in + n_out) / wall if wall else 0.0, "kv_bytes_peak": 0,
            "cache_policy": job.runtime.cache_policy, "batch_size": 0, "device": str(self.engine.device),
            "attempt": attempt, **result.stats, "host": socket.gethostname(), "worker": self.name,
            "finished_at": time.time(),
        })
        won = self.out.commit(spec.shard_id, attempt, {"generations": result.table, "stats": stats},
                              {"kind": spec.kind, "rows": len(rows.ids), "rows_failed": 0, "worker": self.name},
                              staging)
        log.debug("shard %s: %d rows, %d output tokens, %.2fs (%s)", spec.shard_id, len(rows.ids), n_out, wall,
                  "committed" if won else "already committed")
        return {"shard_id": spec.shard_id, "rows": len(rows.ids), "output_tokens": n_out, "wall_s": wall,
                "committed": won, "attempt": attempt, "worker": self.name}

    # ---- what a task reads a shard through (`tasks.base.ShardSource`) ---------------------------
    @property
    def files(self) -> list[InputFile]:
        return self.ctx.files

    @property
    def id_kind(self) -> str:
        return self.ctx.id_kind

    @property
    def passthrough_types(self) -> dict[str, pa.DataType]:
        return self.ctx.passthrough_types

    def shard_rows(self, spec: ShardSpec) -> list[tuple[int, int, Frame, int]]:
        """(file index, row index, frame, the row's position in the frame) for each row of the shard,
        in order. Parquet rows are read by row group (`read_rows`: a 16-row shard reads one group, not
        the file); other formats from the whole file, parsed once and cached."""
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

