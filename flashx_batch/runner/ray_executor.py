"""The Ray executor (`executor.kind=ray`, the default): a pool of ShardWorker actors fed from a queue.

Who calls it: `runner.job.run`. It starts a local Ray (or joins `executor.address`), creates one
actor per accelerator — pinned with the backend's `ray_options()` (`num_gpus=1`, `{"NPU": 1}`) or
`cpus_per_actor` CPUs — and hands each idle actor the next shard descriptor. One shard in flight
per actor keeps a slow shard from holding up the others. Failures follow `runner.failures.decide`:
an actor that dies is replaced and its shard goes back to the front of the queue (split once it
died twice, to isolate a poison row); a shard over `executor.shard_timeout_s` (the watchdog, checked
every `_WAIT_S`) has its actor killed and is retried; a fatal engine error retires the actor.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashx_batch.backends import BACKENDS
from flashx_batch.config import JobConfig
from flashx_batch.data.plan import ShardSpec
from flashx_batch.runner.executor import ExecResult
from flashx_batch.runner.failures import DIED, FATAL, TIMEOUT, FailedRows, Work, decide, kind_of
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.signals import StopFlag
from flashx_batch.runner.worker import ShardWorker, WorkerContext

log = logging.getLogger(__name__)
_WAIT_S = 0.5  # also the watchdog's resolution
_MAX_BOOT_FAILURES = 8  # actors that die while loading their engine, in a row, before the job gives up


class RayExecutor:
    def __init__(self, job: JobConfig, ctx: WorkerContext, failed_rows: FailedRows,
                 on_dispatch: Callable[[ShardSpec, int, str], None] | None = None) -> None:
        """`failed_rows` commits rows given up (timeout, worker_crash); `on_dispatch(shard, attempt,
        actor_name)` is called as each shard is handed out (tests use it)."""
        self.job, self.ctx, self.on_dispatch, self.failed_rows = job, ctx, on_dispatch, failed_rows
        self.timeout_s = job.executor.shard_timeout_s
        self._spawned = 0
        self._boot_failures = 0

    def run(self, shards: list[ShardSpec], stop: StopFlag, progress: Progress) -> ExecResult:
        import ray

        result = ExecResult()
        if not shards:
            return result
        started_ray = self._init_ray(ray)
        stop.install()  # after ray.init, so our handlers are the ones in place
        try:
            return self._loop(ray, shards, stop, progress, result)
        finally:
            if started_ray:
                ray.shutdown()

    # ---- setup ------------------------------------------------------------------------------
    def _init_ray(self, ray: Any) -> bool:
        if ray.is_initialized():
            return False
        address = self.job.executor.address
        if address is None:
            # Workers of a local Ray inherit our environment: make this source tree importable there too.
            pkg_parent = str(Path(__file__).resolve().parents[2])
            paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            if pkg_parent not in paths:
                os.environ["PYTHONPATH"] = os.pathsep.join([pkg_parent, *paths])
            ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, log_to_driver=True,
                     configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=True, configure_logging=False)
        return True

    def _actor_options(self, resources: dict[str, float]) -> tuple[dict[str, Any], int, int | None]:
        """(actor options, pool size, engine threads) for this cluster and backend."""
        ex, name = self.job.executor, self.job.runtime.backend
        if name == "auto":  # decided by what the cluster offers, not by the driver's own devices
            name = "npu" if resources.get("NPU") else "cuda" if resources.get("GPU") else "cpu"
        options = dict(BACKENDS[name]().ray_options(ex.resources)) if name in BACKENDS else {}
        threads = None
        if name == "cpu":
            options["num_cpus"] = ex.cpus_per_actor
            threads = ex.cpus_per_actor
            capacity = int(resources.get("CPU", 1)) // ex.cpus_per_actor
        else:
            options["num_cpus"] = 1
            capacity = int(resources.get("NPU" if name == "npu" else "GPU", 1))
        return options, max(1, ex.num_actors or capacity), threads

    def _spawn(self, ray: Any, remote_cls: Any, options: dict[str, Any], ctx: WorkerContext) -> tuple[str, Any]:
        self._spawned += 1
        name = f"flashx-worker-{os.getpid()}-{self._spawned}"
        handle = remote_cls.options(name=name, max_restarts=0, **options).remote(self.job, ctx, name)
        return name, handle

    # ---- the dispatch loop ------------------------------------------------------------------
    def _loop(self, ray: Any, shards: list[ShardSpec], stop: StopFlag, progress: Progress,
              result: ExecResult) -> ExecResult:
        options, pool, threads = self._actor_options(ray.cluster_resources())
        pool = min(pool, len(shards))
        ctx = WorkerContext(**{**vars(self.ctx), "num_threads": self.ctx.num_threads or threads})
        remote_cls = ray.remote(ShardWorker)
        log.info("ray: %d actor(s) with %s", pool, options)
        self._new_actor = lambda: self._spawn(ray, remote_cls, options, ctx)
        self.actors: dict[str, Any] = {}
        self.booting: dict[Any, str] = {}  # ready() ref -> actor name: no shard goes to an actor still loading
        self.idle: deque[str] = deque()
        for _ in range(pool):
            self._boot()
        ray.get(list(self.booting))  # engines loaded: a load error surfaces here, before any shard runs
        self.idle.extend(self.booting.values())
        self.booting.clear()
        progress.restart_clock()
        queue = deque(Work(spec, 1) for spec in shards)
        inflight: dict[Any, tuple[str, Work, float]] = {}  # ref -> (actor, work, dispatched at)
        while True:
            while self.idle and queue and not stop.requested:
                name, work = self.idle.popleft(), queue.popleft()
                ref = self.actors[name].run_shard.remote(work.spec, work.attempt)
                inflight[ref] = (name, work, time.monotonic())
                if self.on_dispatch is not None:
                    self.on_dispatch(work.spec, work.attempt, name)
            if not inflight and (stop.requested or not queue):
                break
            done, _ = ray.wait([*inflight, *self.booting], num_returns=1, timeout=_WAIT_S)
            progress.tick()
            for ref in done:
                if ref in self.booting:
                    self._booted(ray, ref)
                    continue
                name, work, _ = inflight.pop(ref)
                outcome = self._settle(ray, ref, name, work)
                self._follow(outcome, work, queue, result, progress)
            if self.timeout_s is not None:
                self._watchdog(ray, inflight, queue, result, progress)
        result.interrupted = stop.requested and bool(queue)
        for handle in self.actors.values():
            ray.kill(handle)
        return result

    def _watchdog(self, ray: Any, inflight: dict, queue: deque, result: ExecResult, progress: Progress) -> None:
        """Kill the actor of every piece running past its budget; the piece fails as a `timeout`."""
        for ref, (name, work, since) in list(inflight.items()):
            if time.monotonic() - since > self.timeout_s:
                del inflight[ref]  # its eventual RayActorError is not a second failure
                log.warning("watchdog: shard %s attempt %d on %s exceeded executor.shard_timeout_s=%s; killing "
                            "the actor", work.spec.shard_id, work.attempt, name, self.timeout_s)
                self._replace(ray, name)
                self._follow((TIMEOUT, f"no result within executor.shard_timeout_s={self.timeout_s}s"), work,
                             queue, result, progress)

    def _settle(self, ray: Any, ref: Any, name: str, work: Work) -> tuple[str, Any]:
        """("ok", summary) or (failure kind, message); replaces the actor when it died or its engine did."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            summary = ray.get(ref)
        except RayActorError as exc:
            self._replace(ray, name, dead=True)
            return DIED, _first_line(exc)
        except RayTaskError as exc:
            kind = kind_of(exc)
            if kind == FATAL:  # the engine is gone: retire the actor, never retry on it
                self._replace(ray, name)
            else:
                self.idle.append(name)
            return kind, _first_line(exc)
        self.idle.append(name)
        return "ok", summary

    def _follow(self, outcome: tuple[str, Any], work: Work, queue: deque, result: ExecResult,
                progress: Progress) -> None:
        kind, detail = outcome
        if kind == "ok":
            result.done.append(work.spec.shard_id)
            progress.advance(detail["rows"], detail["output_tokens"])
            return
        log.warning("shard %s attempt %d failed (%s): %s", work.spec.shard_id, work.attempt, kind, detail)
        decision = decide(work, kind, self.job.executor.max_attempts)
        queue.extendleft(reversed(decision.retry))  # front: they are among the longest left
        if len(decision.retry) == 2:
            log.warning("shard %s: its worker died again; split into %s and %s to isolate the row that kills it",
                        work.spec.shard_id, decision.retry[0].spec.shard_id, decision.retry[1].spec.shard_id)
        if decision.give_up is not None:
            message = (f"{'the worker process died' if kind == DIED else 'timed out'} on this row "
                       f"{work.attempt} time(s); last: {detail}")
            progress.advance(self.failed_rows.commit(work, decision.give_up, message), 0)
        if decision.fail:
            result.failed[work.spec.shard_id] = detail

    # ---- actors -----------------------------------------------------------------------------
    def _boot(self) -> None:
        name, handle = self._new_actor()
        self.actors[name] = handle
        self.booting[handle.ready.remote()] = name

    def _booted(self, ray: Any, ref: Any) -> None:
        from ray.exceptions import RayActorError

        name = self.booting.pop(ref)
        try:
            ray.get(ref)
        except RayActorError:  # killed while loading (a node lost, a test): try another one
            self.actors.pop(name, None)
            self._boot_failures += 1
            if self._boot_failures > _MAX_BOOT_FAILURES:
                raise
            self._boot()
            return
        self._boot_failures = 0
        self.idle.append(name)

    def _replace(self, ray: Any, name: str, dead: bool = False) -> None:
        handle = self.actors.pop(name, None)
        if handle is not None and not dead:
            ray.kill(handle, no_restart=True)
        self._boot()


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
