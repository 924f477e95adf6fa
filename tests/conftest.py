import os
import sys
from pathlib import Path

import pytest

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
    if _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
