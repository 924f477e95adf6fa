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
