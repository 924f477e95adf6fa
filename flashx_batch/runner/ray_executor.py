"""The Ray executor (`executor.kind=ray`, the default): a pool of ShardWorker actors fed from a queue.

Who calls it: `runner.job.run`. It starts a local Ray (or joins `executor.address`), creates one
actor per accelerator — pinned with the backend's `ray_options()` (`num_gpus=1`, `{"NPU": 1}`) or
`cpus_per_actor` CPUs — and hands each idle actor the next shard descriptor. One shard in flight
per actor keeps a slow shard from holding up the others. An actor that dies is replaced and its
shard goes back to the front of the queue, up to `executor.max_attempts` tries.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashx_batch.backends import BACKENDS
from flashx_batch.config import JobConfig
from flashx_batch.data.plan import ShardSpec
from flashx_batch.runner.executor import ExecResult
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.signals import StopFlag
from flashx_batch.runner.worker import ShardWorker, WorkerContext

log = logging.getLogger(__name__)
_WAIT_S = 0.5


class RayExecutor:
    def __init__(self, job: JobConfig, ctx: WorkerContext,
                 on_dispatch: Callable[[ShardSpec, int, str], None] | None = None) -> None:
        """`on_dispatch(shard, attempt, actor_name)` is called as each shard is handed out (tests use it)."""
        self.job, self.ctx, self.on_dispatch = job, ctx, on_dispatch
        self._spawned = 0

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
        from ray.exceptions import RayActorError, RayTaskError

        options, pool, threads = self._actor_options(ray.cluster_resources())
        pool = min(pool, len(shards))
        ctx = WorkerContext(**{**vars(self.ctx), "num_threads": self.ctx.num_threads or threads})
        remote_cls = ray.remote(ShardWorker)
        log.info("ray: %d actor(s) with %s", pool, options)
        actors = dict(self._spawn(ray, remote_cls, options, ctx) for _ in range(pool))
        idle = deque(actors)
        ray.get([h.ready.remote() for h in actors.values()])  # engines loaded: a load error surfaces here
        progress.restart_clock()
        queue = deque((spec, 1) for spec in shards)
        inflight: dict[Any, tuple[str, ShardSpec, int]] = {}
        max_attempts = self.job.executor.max_attempts
        while True:
            while idle and queue and not stop.requested:
                name = idle.popleft()
                spec, attempt = queue.popleft()
                inflight[actors[name].run_shard.remote(spec, attempt)] = (name, spec, attempt)
                if self.on_dispatch is not None:
                    self.on_dispatch(spec, attempt, name)
            if not inflight:
                break
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=_WAIT_S)
            progress.tick()
            for ref in done:
                name, spec, attempt = inflight.pop(ref)
                try:
                    summary = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    died = isinstance(exc, RayActorError)
                    log.warning("shard %s attempt %d on %s failed%s: %s", spec.shard_id, attempt, name,
                                " (actor died)" if died else "", str(exc).splitlines()[0])
                    if died:
                        actors.pop(name, None)
                        name, handle = self._spawn(ray, remote_cls, options, ctx)
                        actors[name] = handle
                    idle.append(name)
                    if attempt < max_attempts:
                        queue.appendleft((spec, attempt + 1))  # front: it is among the longest left
                    else:
                        result.failed[spec.shard_id] = str(exc).splitlines()[0]
                    continue
                idle.append(name)
                result.done.append(spec.shard_id)
                progress.advance(summary["rows"], summary["output_tokens"])
        result.interrupted = stop.requested and bool(queue)
        for handle in actors.values():
            ray.kill(handle)
        return result
