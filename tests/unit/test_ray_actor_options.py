"""Actor options for `executor.kind=ray`: `runtime.backend=auto` decided by what the cluster offers
(and, where resources cannot tell kinds apart, by a worker), checked without starting Ray."""

import pytest

from flashx_batch.config import JobConfig
from flashx_batch.runner import ray_executor


def _job(backend="auto", resources=None):
    job = JobConfig()
    job.runtime.backend = backend
    job.executor.resources = resources or {}
    return job


@pytest.fixture
def worker(monkeypatch):
    """The worker's own `resolve_name("auto")`, as `_ask_worker` would bring it back."""
    asked = []

    def answer(name):
        def ask(options):
            asked.append(options)
            return name
        monkeypatch.setattr(ray_executor, "_ask_worker", ask)
        return asked
    return answer


def test_cpu_cluster_needs_no_worker(worker):
    asked = worker("cuda")
    options, pool, threads = ray_executor.actor_options(_job(), {"CPU": 8})
    cpus = JobConfig().executor.cpus_per_actor
    assert options == {"num_cpus": cpus} and pool == 8 // cpus and threads == cpus and not asked


@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_gpus_are_resolved_on_a_gpu_worker(worker, kind):
    asked = worker(kind)
    options, pool, threads = ray_executor.actor_options(_job(), {"CPU": 8, "GPU": 4})
    assert options == {"num_gpus": 1.0, "num_cpus": 1} and pool == 4 and threads is None
    assert asked == [{"num_gpus": 1.0}]


def test_undetected_dcus_behind_a_custom_resource_run_rocm(worker):
    asked = worker("rocm")
    options, pool, _ = ray_executor.actor_options(_job(resources={"DCU": 1}), {"CPU": 16, "DCU": 3})
    assert options == {"resources": {"DCU": 1}, "num_cpus": 1} and pool == 3
    assert asked == [{"resources": {"DCU": 1}}]


def test_npu_cluster(worker):
    worker("npu")
    options, pool, _ = ray_executor.actor_options(_job(), {"CPU": 8, "NPU": 8})
    assert options == {"resources": {"NPU": 1}, "num_cpus": 1} and pool == 8


def test_a_named_backend_asks_no_worker(worker):
    asked = worker("rocm")
    options, pool, _ = ray_executor.actor_options(_job("cuda"), {"CPU": 8, "GPU": 2})
    assert options == {"num_gpus": 1.0, "num_cpus": 1} and pool == 2 and not asked
