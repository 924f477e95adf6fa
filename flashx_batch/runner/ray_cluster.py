"""The Ray cluster as a job meets it before its pool starts: `ray_session` (start a local Ray or join
`executor.address`, with the job's signal handling kept), `probe_cluster` (the backend and a
replica's ranks checked on a worker before any output is touched), and `actor_options` (how many
actors of what shape the cluster holds). `runner.ray_executor.RayExecutor` runs the pool itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flashx_batch.backends import BACKENDS, resolve_for_ray
from flashx_batch.config import JobConfig
from flashx_batch.errors import ConfigError, FlashxError
from flashx_batch.runner.failures import clean
from flashx_batch.runner.replicas import bundle_of
from flashx_batch.runner.signals import Interrupted, StopFlag

log = logging.getLogger(__name__)
_PROBE_TIMEOUT_S = 300.0  # a busy cluster may take a while to schedule the probe; past this, go on unprobed


@contextlib.contextmanager
def ray_session(job: JobConfig, stop: StopFlag) -> Iterator[None]:
    """Ray for the length of a job: started (or joined) here unless the caller already has it, and
    shut down on the way out if started here."""
    import ray

    started = start_ray(ray, job, stop)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def start_ray(ray: Any, job: JobConfig, stop: StopFlag) -> bool:
    """Start a local Ray or join `executor.address`; True if this call did.

    `ray.init` installs SIGTERM handlers of its own that `sys.exit` (2 or 1 for a scheduler, and no
    word in the log); a SystemExit out of it is therefore a SIGTERM during start-up and becomes our
    interruption (143). Our handlers are put back as soon as it returns."""
    if ray.is_initialized():
        return False
    try:
        _init_ray(ray, job.executor.address)
    except SystemExit as exc:
        with contextlib.suppress(Exception):
            ray.shutdown()
        if exc.code not in (signal.SIGTERM, 1):  # Ray's two SIGTERM handlers exit with these
            raise
        stop.signum = signal.SIGTERM
        log.warning("SIGTERM received while Ray was starting: stopping")
        raise Interrupted(stop.exit_code) from None
    except ConnectionError as exc:
        raise FlashxError(f"cannot reach the Ray cluster at executor.address={job.executor.address}: "
                          f"{_first_line(exc)}; check the address and that the cluster is up.") from None
    finally:
        stop.install()  # after ray.init, so our handlers are the ones in place
    return True


def _init_ray(ray: Any, address: str | None) -> None:
    if not sys.stderr.isatty():  # a log file or a scheduler's capture: Ray's colour codes would be noise there
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if address is None:
        # Workers of a local Ray inherit our environment: make this source tree importable there too.
        pkg_parent = str(Path(__file__).resolve().parents[2])
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if pkg_parent not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([pkg_parent, *paths])
        # "local": always a Ray of this job's own, never a cluster another process on this machine started
        ray.init(address="local", num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=True, configure_logging=False)


def probe_cluster(job: JobConfig) -> str | None:
    """Before the output directory is touched: does the cluster offer what one actor needs, and does
    the backend work there? One task with the actor's resources runs `get_backend` on a worker node
    (after, for `auto` on a cluster with devices, one that resolves it there: `resolve_for_ray`);
    a refusal there is a bad job (ConfigError, exit 2), never an actor that dies at load. Returns
    `backend/dtype` as the worker resolved them (`backends.resolved_run`; None when the probe was not
    scheduled in time)."""
    import ray

    resources = ray.cluster_resources()
    options, _, _ = actor_options(job, resources)
    needed = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    short = {k: v for k, v in needed.items() if v and resources.get(k, 0) < v}
    if short:
        raise ConfigError(f"runtime.backend={job.runtime.backend}: one actor needs {short}, and the Ray cluster offers "
                          f"{ {k: resources.get(k, 0) for k in short} }; pick a backend the cluster has, or add "
                          "nodes with those resources.")
    tp = job.runtime.tensor_parallel_size
    if tp > 1:
        _check_replica_fits(ray, job, bundle_of(options), tp)
    ref = ray.remote(_probe_backend).options(**options).remote(job.runtime.backend, job.model.dtype)
    failure, resolved = _run_on_worker(ray, ref, "backend probe") or (None, None)
    if failure is not None:
        raise ConfigError(f"runtime.backend={job.runtime.backend} cannot run on the Ray workers: {failure}")
    return resolved


def _check_replica_fits(ray: Any, job: JobConfig, bundle: dict[str, float], tp: int) -> None:
    """A tensor-parallel replica's N ranks share one node (STRICT_PACK): some node must offer N bundles."""
    if replicas_that_fit(ray.nodes(), bundle, tp) == 0:
        raise ConfigError(f"runtime.tensor_parallel_size={tp}: a replica's {tp} ranks must share one node, each taking "
                          f"{bundle}, and no node of this cluster holds {tp} of them. Lower tensor_parallel_size, or "
                          "add a node with enough devices.")


def _run_on_worker(ray: Any, ref: Any, what: str) -> Any:
    """The result of a small task started on a worker; None if it was not scheduled within
    `_PROBE_TIMEOUT_S` (a busy cluster: the caller goes on without it)."""
    ready, _ = ray.wait([ref], timeout=_PROBE_TIMEOUT_S)
    if not ready:
        ray.cancel(ref, force=True)
        log.warning("%s not scheduled within %.0fs (a busy cluster?); going on without it", what, _PROBE_TIMEOUT_S)
        return None
    try:
        return ray.get(ref)
    except Exception as exc:  # the task's worker died, or could not import flashx_batch
        raise FlashxError(f"the {what} failed on a Ray worker: {_first_line(exc)}; check that every node "
                          "has flashx-batch installed (the same version as the driver).") from None


def _probe_backend(name: str, dtype: str) -> tuple[str | None, str | None]:
    """Runs on a worker: (None, `backend/dtype` as an engine there runs them) if the backend resolves
    there, else (its error message, None)."""
    try:
        from flashx_batch.backends import resolved_run

        return None, resolved_run(name, dtype)
    except Exception as exc:
        return f"{type(exc).__name__}: {clean(str(exc))} (on {os.uname().nodename})", None


def _resolve_auto() -> str:
    """Runs on a worker: what `runtime.backend=auto` is there (the engine resolves it the same way)."""
    from flashx_batch.backends import resolve_name

    return resolve_name("auto")


# (Ray job id, actor options) -> the worker's answer: the probe and the executor of one job ask once
_resolved_on_worker: dict[tuple[str, str], str | None] = {}


def _ask_worker(options: dict[str, Any]) -> str | None:
    """`runtime.backend=auto` resolved on a worker placed with `options` (see `backends.resolve_for_ray`)."""
    import ray

    key = (ray.get_runtime_context().get_job_id(), repr(sorted(options.items())))
    if key not in _resolved_on_worker:
        ref = ray.remote(_resolve_auto).options(**options).remote()
        _resolved_on_worker[key] = _run_on_worker(ray, ref, "backend resolution")
    return _resolved_on_worker[key]


def _backend_name(job: JobConfig, resources: dict[str, float]) -> str:
    return resolve_for_ray(job.runtime.backend, resources, job.executor.resources, _ask_worker)


def actor_options(job: JobConfig, resources: dict[str, float], nodes: list[dict[str, Any]] | None = None
                  ) -> tuple[dict[str, Any], int, int | None]:
    """(options of one actor (one rank), pool size in replicas, engine threads) for this cluster and backend."""
    ex, name = job.executor, _backend_name(job, resources)
    options = dict(BACKENDS[name]().ray_options(ex.resources)) if name in BACKENDS else {}
    threads = None
    if name == "cpu":
        options["num_cpus"] = ex.cpus_per_actor
        threads = ex.cpus_per_actor
        capacity = int(resources.get("CPU", 1)) // ex.cpus_per_actor
    else:
        options["num_cpus"] = 1
        # as many actors as the scarcest resource one actor asks for allows (none asked: one per GPU, or one)
        needed = {"GPU": options.get("num_gpus", 0), **options.get("resources", {})}
        capacity = min((int(resources.get(k, 0) // v) for k, v in needed.items() if v),
                       default=int(resources.get("GPU", 1)))
    if ex.runtime_env:
        options["runtime_env"] = dict(ex.runtime_env)
    tp = job.runtime.tensor_parallel_size
    if tp == 1:
        return options, max(1, ex.num_actors or capacity), threads
    # a replica's N ranks share one node: count what each node holds (`executor.num_actors` counts replicas,
    # capped there: a placement group that can never be placed would wait forever)
    fit = replicas_that_fit(nodes or [], bundle_of(options), tp) if nodes is not None else capacity // tp
    if ex.num_actors and ex.num_actors > fit:
        log.warning("executor.num_actors=%d replicas of %d ranks asked for; the cluster's nodes hold %d",
                    ex.num_actors, tp, fit)
    return options, max(1, min(ex.num_actors or fit, fit)), threads


def replicas_that_fit(nodes: list[dict[str, Any]], bundle: dict[str, float], tp: int) -> int:
    """Tensor-parallel replicas of `tp` bundles the alive `nodes` (`ray.nodes()`) hold, each on one node."""
    total = 0
    for node in nodes:
        if node.get("Alive"):
            have = node.get("Resources", {})
            total += min(int(have.get(k, 0) // v) for k, v in bundle.items()) // tp
    return total


def _first_line(exc: BaseException) -> str:
    lines = [line for line in clean(str(exc)).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
