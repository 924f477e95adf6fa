import os
import sys
from pathlib import Path

# OpenMP threads that wait by sleeping, not spinning, set before anything loads libgomp (and inherited by
# subprocesses, rank processes and Ray workers): with two pytest workers, or a test's engine beside its
# reference model, spinning threads take the cores the other process needs (3-4x slower on 2 cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/model_factory.py


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: on a shared CPU, OpenMP siblings waiting on each other cost more than they add."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (model dir, transformers model): one random tiny model per supported family."""
    from model_factory import ARCHS, build

    root = tmp_path_factory.mktemp("models")
    return {arch: (root / arch, build(arch, root / arch)) for arch in ARCHS}


# Whole jobs (tests/integration: Ray clusters, an S3 server, processes killed on a timer) and the unit modules
# that start Ray or an S3 server: under `make test` (two pytest workers) they all run on one worker, one at a
# time, while the other worker takes the rest of the unit tests, so no two Ray clusters or S3 servers ever
# share the machine and the timing-sensitive tests never meet a second job of their own kind.
SERIAL_MODULES = {"test_ray_actor_options", "test_object_layout"}


# The slow tier (`make test-fast` leaves it out): whole jobs (tests/integration) and the unit modules whose
# tests take tens of seconds each (parity across model families, spawned tensor-parallel ranks, ONNX export,
# benchmark harness runs, property fuzzes, a real checkpoint's load memory).
SLOW_MODULES = {
    "test_mla", "test_tensor_parallel", "test_moe", "test_onnx", "test_runtime_parity", "test_loglikelihood",
    "test_bench_gate", "test_bench_moe", "test_bench_eval", "test_fuzz_preflight", "test_yarn", "test_load_memory",
    "test_doctor", "test_commit_protocol_state_machine", "test_kv_merge", "test_prefix_reuse", "test_int8_decode",
    "test_quality_ablations", "test_kv_sparse_bench", "test_attention_backends", "test_sliding_window",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.module.__name__.rpartition(".")[2]
        whole_job = "/integration/" in str(item.fspath)
        if name in SERIAL_MODULES or whole_job:
            item.add_marker(pytest.mark.xdist_group("serial"))
        if name in SLOW_MODULES or whole_job:
            item.add_marker(pytest.mark.slow)


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with the tests' own status once pytest has reported everything. One clean-clone
    run (746 passed) segfaulted after its summary, in interpreter teardown, where the native thread
    pools this process has run (torch's OpenMP, numba's OpenMP for the CPU kernels, Ray's client) are
    torn down in no fixed order; the job processes exit through their own paths. Flushing and leaving
    here keeps a crash after the last test from turning a passed run into a failed one."""
    if _exit_status and not hasattr(config, "workerinput"):  # the controller, not a pytest-xdist worker
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
