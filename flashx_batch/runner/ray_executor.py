"""The Ray executor (`executor.kind=ray`, the default): a pool of ShardWorker actors fed from a queue.

Who calls it: `runner.job.run`. It starts a local Ray (or joins `executor.address`), creates one
actor per accelerator — pinned with the backend's `ray_options()` (`num_gpus=1`, `{"NPU": 1}`) or
`cpus_per_actor` CPUs — and hands each idle actor the next shard descriptor. One shard in flight
per actor keeps a slow shard from holding up the others. Failures follow `runner.failures.decide`:
the retry state machine is `runner.retries`, shared with the local executor; an actor that dies is
replaced and its shard goes back to the front of the queue (split once it died twice, to isolate a
poison row); a shard over `executor.shard_timeout_s` (the watchdog, checked
every `_WAIT_S`) has its actor killed and is retried; a fatal engine error retires the actor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from flashx_batch.config import JobConfig
from flashx_batch.data.plan import ShardSpec
from flashx_batch.errors import ConfigError, FlashxError
from flashx_batch.job_errors import InputChangedError, ModelChangedError
from flashx_batch.runner.executor import ExecResult
from flashx_batch.runner.failures import BAD_JOB, DIED, FATAL, TIMEOUT, FailedRows, Work, WorkerFailure
from flashx_batch.runner.node_book import NodeBook
from flashx_batch.runner.progress import Progress
from flashx_batch.runner.ray_cluster import _first_line, actor_options, ray_session
from flashx_batch.runner.replicas import Replica, bundle_of, start_replica
from flashx_batch.runner.retries import Retries
from flashx_batch.runner.signals import StopFlag
from flashx_batch.runner.worker import ShardWorker, WorkerContext

log = logging.getLogger(__name__)
_WAIT_S = 0.5  # also the watchdog's resolution
_POLL_S = 2.0  # how often the pool reads Ray's node table (nodes joining, leaving)
_MAX_BOOT_FAILURES = 8  # actors that die while loading their engine, in a row, before the job gives up
# a replacement's load failure that no retry can cure (failures travel as data: matched by type name)
_JOB_LEVEL = (ModelChangedError.__name__, InputChangedError.__name__)
# a busy replica that lost a rank: how long its rank 0 gets to report the broken replica before it is killed
_RANK_LEFT_GRACE_S = 10.0


class RayExecutor:
    def __init__(self, job: JobConfig, ctx: WorkerContext, failed_rows: FailedRows,
                 on_dispatch: Callable[[ShardSpec, int, str], None] | None = None) -> None:
        """`failed_rows` commits rows given up (timeout, worker_crash); `on_dispatch(shard, attempt,
        actor_name)` is called as each shard is handed out (tests use it)."""
        self.job, self.ctx, self.on_dispatch, self.failed_rows = job, ctx, on_dispatch, failed_rows
        self.timeout_s = job.executor.shard_timeout_s
        self._spawned = 0
        self._boot_failures = 0
        # the pool's state for one run (`_loop` fills it)
        self._ray: Any = None
        self._new_actor: Callable[[], tuple[Replica, Any] | None] = lambda: None
        self.book: NodeBook | None = None
        self.retries: Retries | None = None
        self._polled = 0.0  # when Ray's node table was last read
        self._short_logged: tuple | None = None
        self._most = 0  # the most actors the pool has held at once
        self.actors: dict[str, Replica] = {}
        self.booting: dict[Any, str] = {}  # ready() ref -> actor name: no shard goes to an actor still loading
        self.watch: dict[Any, str] = {}  # a follower rank's follow() ref -> its replica (it ends: the replica goes)
        self.doomed: dict[str, float] = {}  # busy replicas that lost a rank -> when to kill them if still busy
        self.rank_lost: set[str] = set()  # busy replicas that lost a rank: their shard's failure is `fatal`
        self.idle: deque[str] = deque()

    def run(self, shards: list[ShardSpec], stop: StopFlag, progress: Progress) -> ExecResult:
        import ray

        result = ExecResult()
        if not shards:
            return result
        with ray_session(self.job, stop):
            return self._loop(ray, shards, stop, progress, result)

    def _spawn(self, ray: Any, remote_cls: Any, options: dict[str, Any], ctx: WorkerContext
               ) -> tuple[Replica, Any] | None:
        """A new replica (booting), or None when no usable node has room for one."""
        name = f"flashx-worker-{os.getpid()}-{self._spawned + 1}"
        if self.book is not None:  # single-rank actors are placed on a node of our choosing (`runner.node_book`)
            node_id = self.book.place(name)
            if node_id is None:
                return None
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options = {**options, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
        self._spawned += 1
        return start_replica(ray, remote_cls, options, self.job.runtime.tensor_parallel_size, name, (self.job, ctx))

    # ---- the dispatch loop ------------------------------------------------------------------
    def _loop(self, ray: Any, shards: list[ShardSpec], stop: StopFlag, progress: Progress,
              result: ExecResult) -> ExecResult:
        options, pool, threads = actor_options(self.job, ray.cluster_resources(), ray.nodes())
        pool = min(pool, len(shards))
        ctx = WorkerContext(**{**vars(self.ctx), "num_threads": self.ctx.num_threads or threads})
        remote_cls = ray.remote(ShardWorker)
        tp = self.job.runtime.tensor_parallel_size
        log.info("ray: %d %s with %s", pool, "actor(s)" if tp == 1 else f"replica(s) of {tp} ranks", options)
        self._new_actor = lambda: self._spawn(ray, remote_cls, options, ctx)
        # placement, failure domains, exclusion and the elastic pool: single-rank actors (a tensor-parallel
        # replica's placement group is placed by Ray)
        ex = self.job.executor
        self.book = NodeBook(bundle_of(options), ex.node_failure_limit, ex.num_actors) if tp == 1 else None
        if self.book is not None:
            self.book.refresh(ray.nodes())
        self._polled, self._ray = time.monotonic(), ray
        try:
            return self._dispatch_all(ray, pool, shards, stop, progress, result)
        finally:  # however the loop ends, no actor of this run outlives it (the driver unlocks next)
            for replica in self.actors.values():
                replica.kill(ray)
            if self.book is not None:
                with contextlib.suppress(Exception):  # the summary as the cluster stands at the end
                    self.book.refresh(ray.nodes())
                result.nodes = self.book.summary()

    def _dispatch_all(self, ray: Any, pool: int, shards: list[ShardSpec], stop: StopFlag, progress: Progress,
                      result: ExecResult) -> ExecResult:
        for _ in range(pool):
            self._boot()
        # engines loaded: a load error surfaces here, as data, before any shard runs; the first boot
        # failing is the job's (model, config) rather than one node's
        for info in ray.get(list(self.booting)):
            if "failure" in info:
                _raise_boot_failure(WorkerFailure.from_dict(info["failure"]))
        self.idle.extend(self.booting.values())
        if self.book is not None:
            self.book.ready.update(self.booting.values())
        self.booting.clear()
        progress.restart_clock()
        self.retries = Retries(shards, self.job.executor.max_attempts, result, progress, self.failed_rows)
        queue = self.retries.queue
        inflight: dict[Any, tuple[str, Work, float]] = {}  # ref -> (actor, work, dispatched at)
        while True:
            self._dispatch(queue, inflight, stop)
            if self.book is not None and time.monotonic() - self._polled >= _POLL_S:
                self._rescale(ray, len(queue) + len(inflight))
            if queue and not inflight and not self.actors and self.book is not None and self.book.all_excluded():
                _every_node_excluded(self.book, queue, result)
                break
            if not inflight and (stop.requested or not queue):
                break
            done, _ = ray.wait([*inflight, *self.booting, *self.watch], num_returns=1, timeout=_WAIT_S)
            progress.tick()
            for ref in done:
                if ref in self.booting:
                    self._booted(ray, ref)
                    continue
                if ref in self.watch:
                    self._rank_left(ray, ref)
                    continue
                name, work, since = inflight.pop(ref)
                outcome = self._settle(ray, ref, name, work)
                self._follow(outcome, work, time.monotonic() - since, name)
                if result.aborted is not None:
                    break
            if result.aborted is not None:
                break
            if self.timeout_s is not None:
                self._watchdog(ray, inflight)
            if self.doomed:
                self._end_doomed(ray)
        result.interrupted = stop.requested and bool(queue)
        return result

    def _dispatch(self, queue: deque, inflight: dict, stop: StopFlag) -> None:
        """Idle actors take queued work in queue order, each the first piece it may run: not one that
        failed on its node while another node has actors (`NodeBook.may_run`)."""
        for name in list(self.idle):
            if not queue or stop.requested:
                return
            index = next((i for i, w in enumerate(queue)
                          if self.book is None or self.book.may_run(w.spec.shard_id, name)), None)
            if index is None:
                continue
            work = queue[index]
            del queue[index]
            self.idle.remove(name)
            ref = self.actors[name].leader.run_shard.remote(work.spec, work.attempt)
            inflight[ref] = (name, work, time.monotonic())
            if self.on_dispatch is not None:
                self.on_dispatch(work.spec, work.attempt, name)

    def _rescale(self, ray: Any, work_left: int) -> None:
        """The elastic pool, from Ray's node table: actors on nodes that left are dropped (a busy one's
        shard fails and is retried), nodes that joined get actors, up to `executor.num_actors` and no more
        than the work left; a pool short of that says what it waits for."""
        self._polled = time.monotonic()
        self._refresh_nodes(ray)
        while len(self.actors) < work_left and self.book.room() > 0:
            if not self._boot():
                break
        self._most = max(self._most, len(self.actors))
        # a pool below its former size with no room left anywhere: a replacement waits, and says for what
        short = min(work_left, self._most) - len(self.actors)
        state = (short, tuple(sorted(n for n, r in self.book.nodes.items() if r.excluded or not r.alive)))
        if short > 0 and self.book.room() == 0 and state != self._short_logged:
            log.warning("pool: %d actor(s), %d replacement(s) waiting for a node with %s (usable nodes full; "
                        "excluded or gone: %s)", len(self.actors), short, self.book.bundle,
                        ", ".join(n[:12] for n in state[1]) or "none")
            self._short_logged = state

    def _refresh_nodes(self, ray: Any) -> None:
        """Read Ray's node table: log nodes that joined; actors on nodes that left are dropped at once
        when idle (a busy one's shard fails and is retried; a booting one's boot fails)."""
        joined, lost = self.book.refresh(ray.nodes())
        for node_id in joined:
            log.info("pool: node %s joined with room for %d actor(s)", node_id[:12], self.book.nodes[node_id].capacity)
        for name in lost:
            log.warning("pool: %s's node left the cluster", name)
            if name in self.idle:
                self.idle.remove(name)
                replica = self.actors.pop(name, None)
                if replica is not None:
                    replica.kill(ray)
                self.book.remove(name)

    def _exclude(self, node_id: str) -> None:
        """Exclude a node for the rest of the job: its idle actors go now (replaced elsewhere if there is
        room), its busy ones when their shard ends (`_settle`)."""
        log.warning("pool: node %s excluded for the rest of the job: %s", node_id,
                    self.book.nodes[node_id].excluded)
        for name in self.book.actors_on(node_id):
            if name in self.idle:
                self.idle.remove(name)
                self._replace(self._ray, name)

    def _watchdog(self, ray: Any, inflight: dict) -> None:
        """Kill the actor of every piece running past its budget; the piece fails as a `timeout`."""
        for ref, (name, work, since) in list(inflight.items()):
            if time.monotonic() - since > self.timeout_s:
                del inflight[ref]  # its eventual RayActorError is not a second failure
                log.warning("watchdog: shard %s attempt %d on %s exceeded executor.shard_timeout_s=%s; killing "
                            "the actor", work.spec.shard_id, work.attempt, name, self.timeout_s)
                self._replace(ray, name)
                failure = WorkerFailure(TIMEOUT, "Timeout", f"no result within executor.shard_timeout_s="
                                        f"{self.timeout_s}s", worker=name, shard_id=work.spec.shard_id,
                                        attempt=work.attempt)
                self._follow((TIMEOUT, failure), work, None, name)

    def _settle(self, ray: Any, ref: Any, name: str, work: Work) -> tuple[str, Any]:
        """("ok", summary) or (failure kind, WorkerFailure); replaces the actor when it died or its engine did."""
        from ray.exceptions import RayActorError, RayTaskError

        where = {"worker": name, "shard_id": work.spec.shard_id, "attempt": work.attempt}
        lost_rank = name in self.rank_lost  # a rank of this replica left while it ran
        try:
            summary = ray.get(ref)
        except RayActorError as exc:
            if self.book is not None:  # its node may have left: place the replacement with the table as it is now
                self._refresh_nodes(ray)
            self._replace(ray, name)
            if lost_rank:  # killed by us (`_end_doomed`): the replica broke, rank 0 did not die of its shard
                return FATAL, WorkerFailure(FATAL, "ReplicaBroken", "another rank of this replica died; its rank 0 "
                                            "was stopped with the shard in flight", **where)
            return DIED, WorkerFailure(DIED, type(exc).__name__, _first_line(exc), **where)
        except RayTaskError as exc:  # raised outside run_shard's own handling (e.g. an argument that failed)
            summary = {"failure": WorkerFailure.from_exception(exc, **where).as_dict()}
        lost_rank = lost_rank or (self.book is not None and not self.book.usable(name))
        if "failure" in summary:
            failure = WorkerFailure.from_dict(summary["failure"])
            if failure.kind == FATAL or lost_rank:  # the engine is gone: retire the actor, never retry on it
                self._replace(ray, name)
            else:
                self.idle.append(name)
            return failure.kind, failure
        if lost_rank:
            self._replace(ray, name)
        else:
            self.idle.append(name)
        return "ok", summary

    def _follow(self, outcome: tuple[str, Any], work: Work, latency_s: float | None = None,
                name: str | None = None) -> None:
        """A try's outcome through the shared retry state machine, and into the node book (`runner.node_book`:
        a node whose actors fail shard after shard is excluded)."""
        kind, detail = outcome
        if kind == "ok":
            self.retries.succeeded(work, detail, latency_s)
            if self.book is not None and name is not None:
                self.book.succeeded(name)
            return
        self.retries.failed(work, detail)
        if self.book is not None and name is not None and kind != BAD_JOB:
            excluded = self.book.failed(name, work.spec.shard_id, detail.line)
            if excluded is not None:
                self._exclude(excluded)

    # ---- actors -----------------------------------------------------------------------------
    def _boot(self) -> bool:
        """Start one replica; False when no usable node has room (the pool is short until one does)."""
        made = self._new_actor()
        if made is None:
            return False
        replica, ready = made
        self.actors[replica.name] = replica
        self.booting[ready] = replica.name
        self.watch.update({ref: replica.name for ref in replica.watch})
        return True

    def _rank_left(self, ray: Any, ref: Any) -> None:
        """A follower rank's `follow` ended: the rank died, or its replica broke. The whole replica goes:
        an idle one is replaced now; a busy or booting one is killed, and its shard's failure (or its
        failed boot) replaces it."""
        name = self.watch.pop(ref)
        replica = self.actors.get(name)
        if replica is None:  # already replaced
            return
        why = _follow_outcome(ray, ref)
        log.warning("%s: rank %d left (%s); restarting the replica", name, replica.watch.get(ref, 0), why)
        if name in self.idle:
            self.idle.remove(name)
            self._replace(ray, name)
        elif name in self.booting.values():  # its boot cannot succeed: a new one now (a failed boot, counted)
            for boot in [r for r, n in self.booting.items() if n == name]:
                del self.booting[boot]
            self._boot_failures += 1
            if self._boot_failures > _MAX_BOOT_FAILURES:
                raise FlashxError(f"{self._boot_failures} replicas in a row lost a rank while loading; last: {name} "
                                  f"({why})")
            self._replace(ray, name)
        else:  # busy: rank 0 reports the broken replica itself (a truer failure than a kill); a bounded wait
            self.rank_lost.add(name)
            self.doomed[name] = time.monotonic() + _RANK_LEFT_GRACE_S

    def _end_doomed(self, ray: Any) -> None:
        """Kill busy replicas whose rank 0 has not reported a lost rank within the grace (a collective
        library that waits out its timeout instead of failing at once): the shard fails as `fatal`."""
        now = time.monotonic()
        for name, deadline in list(self.doomed.items()):
            if now > deadline:
                del self.doomed[name]
                if name in self.actors:
                    self.actors[name].kill(ray)

    def _booted(self, ray: Any, ref: Any) -> None:
        from ray.exceptions import ActorUnschedulableError, RayActorError

        name = self.booting.pop(ref)
        if name not in self.actors:  # replaced meanwhile (a rank left while it loaded)
            return
        try:
            info = ray.get(ref)
        except (RayActorError, ActorUnschedulableError):  # killed while loading (a node lost, a test, a rank that
            # left), or placed on a node that left before it started: try another one
            if self.book is not None:
                self._refresh_nodes(ray)
            self._boot_failed(ray, name, "its actor died while loading the engine")
            if self._boot_failures > _MAX_BOOT_FAILURES:
                raise
            self._boot()
            return
        if "failure" in info:  # a replacement that cannot load (memory still held, a bad node): another one
            failure = WorkerFailure.from_dict(info["failure"])
            if failure.type in _JOB_LEVEL:
                _raise_boot_failure(failure)
            log.warning("%s", failure.block())
            self._boot_failed(ray, name, failure.line)
            if self._boot_failures > _MAX_BOOT_FAILURES:
                raise FlashxError(f"{self._boot_failures} replacement engines in a row failed to load; last: "
                                  f"{failure.line} on node {failure.node}")
            self._boot()
            return
        self._boot_failures = 0
        if self.book is not None:
            if not self.book.usable(name):  # its node was excluded or left while it loaded
                self._replace(ray, name)
                return
            self.book.ready.add(name)
        self.idle.append(name)

    def _boot_failed(self, ray: Any, name: str, why: str) -> None:
        """A replica that did not load goes; its node is charged with a failure (an engine that will not
        load on a node is that node's problem once it happens for several)."""
        replica = self.actors.pop(name, None)
        if replica is not None:
            replica.kill(ray)
        self._boot_failures += 1
        if self.book is not None:
            self.book.remove(name)
            excluded = self.book.failed(name, f"(engine load: {name})", why)
            if excluded is not None:
                self._exclude(excluded)

    def _replace(self, ray: Any, name: str) -> None:
        """A new replica for `name`'s (every rank of it killed), where there is room (`_rescale` adds it
        later otherwise)."""
        self.doomed.pop(name, None)
        self.rank_lost.discard(name)
        if self.book is not None:
            self.book.remove(name)
        replica = self.actors.pop(name, None)
        if replica is not None:
            replica.kill(ray)
        self._boot()


def _every_node_excluded(book: NodeBook, queue: deque, result: ExecResult) -> None:
    """No node may run work any more: the job fails (resumable) with each node's record."""
    lines = [f"node {n}: {r['failed_attempts']} failed attempt(s), {r['shards']} committed; "
             f"{r['excluded'] or ('left the cluster' if not r['alive'] else 'no room')}"
             for n, r in book.summary().items()]
    log.error("every node of the cluster is excluded; %d piece(s) not run:\n  %s", len(queue),
              "\n  ".join(lines))
    for work in queue:
        result.failed[work.spec.shard_id] = "not run: every node of the cluster was excluded (job.json: nodes)"
    queue.clear()


def _follow_outcome(ray: Any, ref: Any) -> str:
    """What a finished `follow` call says: why the rank stopped, or that its actor died."""
    from ray.exceptions import RayActorError

    try:
        return str(ray.get(ref))
    except RayActorError as exc:
        return f"its actor died: {_first_line(exc)}"
    except Exception as exc:
        return f"{type(exc).__name__}: {_first_line(exc)}"


def _raise_boot_failure(failure: WorkerFailure) -> None:
    """An engine that failed to load on a worker: a bad job (exit 2) when the model or config is at
    fault, otherwise a failure (exit 1); the message carries the worker's own error block."""
    log.error("%s", failure.block())
    message = f"the engine could not load on {failure.worker} (node {failure.node}): {failure.line}"
    raise (ConfigError if failure.kind == BAD_JOB else FlashxError)(message)
