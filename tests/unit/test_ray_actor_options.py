"""Actor options for `executor.kind=ray`: `runtime.backend=auto` decided by what the cluster offers
(and, where resources cannot tell kinds apart, by a worker), checked without starting Ray."""

import pytest

from flashx_batch.config import JobConfig
from flashx_batch.runner import ray_cluster


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
        monkeypatch.setattr(ray_cluster, "_ask_worker", ask)
        return asked
    return answer


def test_cpu_cluster_needs_no_worker(worker):
    asked = worker("cuda")
    options, pool, threads = ray_cluster.actor_options(_job(), {"CPU": 8})
    cpus = JobConfig().executor.cpus_per_actor
    assert options == {"num_cpus": cpus} and pool == 8 // cpus and threads == cpus and not asked


@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_gpus_are_resolved_on_a_gpu_worker(worker, kind):
    asked = worker(kind)
    options, pool, threads = ray_cluster.actor_options(_job(), {"CPU": 8, "GPU": 4})
    assert options == {"num_gpus": 1.0, "num_cpus": 1} and pool == 4 and threads is None
    assert asked == [{"num_gpus": 1.0}]


def test_undetected_dcus_behind_a_custom_resource_run_rocm(worker):
    asked = worker("rocm")
    options, pool, _ = ray_cluster.actor_options(_job(resources={"DCU": 1}), {"CPU": 16, "DCU": 3})
    assert options == {"resources": {"DCU": 1}, "num_cpus": 1} and pool == 3
    assert asked == [{"resources": {"DCU": 1}}]


def test_npu_cluster(worker):
    worker("npu")
    options, pool, _ = ray_cluster.actor_options(_job(), {"CPU": 8, "NPU": 8})
    assert options == {"resources": {"NPU": 1}, "num_cpus": 1} and pool == 8


def test_a_named_backend_asks_no_worker(worker):
    asked = worker("rocm")
    options, pool, _ = ray_cluster.actor_options(_job("cuda"), {"CPU": 8, "GPU": 2})
    assert options == {"num_gpus": 1.0, "num_cpus": 1} and pool == 2 and not asked


def test_tensor_parallel_replicas_are_counted_per_node(worker):
    """A replica's ranks share one node: two nodes of 3 GPUs hold two TP = 2 replicas, not three."""
    worker("cuda")
    job = _job("cuda")
    job.runtime.tensor_parallel_size = 2
    nodes = [{"Alive": True, "Resources": {"CPU": 16, "GPU": 3}}, {"Alive": True, "Resources": {"CPU": 16, "GPU": 3}},
             {"Alive": False, "Resources": {"CPU": 16, "GPU": 8}}]
    options, pool, _ = ray_cluster.actor_options(job, {"CPU": 32, "GPU": 6}, nodes)
    assert options["num_gpus"] == 1 and pool == 2
    job.executor.num_actors = 5  # more than fit: capped (a placement group that never places would wait forever)
    assert ray_cluster.actor_options(job, {"CPU": 32, "GPU": 6}, nodes)[1] == 2


def test_runtime_env_reaches_every_actor(worker):
    job = _job("cpu")
    job.executor.runtime_env = {"env_vars": {"HF_HUB_OFFLINE": "1"}}
    options, _, _ = ray_cluster.actor_options(job, {"CPU": 4})
    assert options["runtime_env"] == {"env_vars": {"HF_HUB_OFFLINE": "1"}}


def test_a_reserved_accelerator_the_engine_cannot_use_is_a_bad_job(monkeypatch):
    import types

    import torch

    import flashx_batch.backends as backends
    from flashx_batch.errors import ConfigError
    from flashx_batch.runner.worker import _check_reserved_accelerator

    on_cpu = types.SimpleNamespace(device=torch.device("cpu"),
                                   backend=types.SimpleNamespace(name="cpu", torch_runtime=True))
    monkeypatch.setattr(backends, "ray_accelerator_ids", lambda: {"GPU": [], "NPU": ["3"]})
    with pytest.raises(ConfigError, match=r"Ray gave this actor \{'NPU': \['3'\]\}.*resolved to the CPU"):
        _check_reserved_accelerator(on_cpu, "auto", "flashx-worker-1")
    monkeypatch.setattr(backends, "ray_accelerator_ids", lambda: {"GPU": []})
    _check_reserved_accelerator(on_cpu, "auto", "flashx-worker-1")  # nothing reserved: a CPU actor
    monkeypatch.setattr(backends, "ray_accelerator_ids", lambda: {"GPU": ["0"]})
    onnx = types.SimpleNamespace(device=torch.device("cpu"),
                                 backend=types.SimpleNamespace(name="onnx", torch_runtime=False))
    _check_reserved_accelerator(onnx, "onnx", "flashx-worker-1")  # ONNX Runtime drives the GPU itself
