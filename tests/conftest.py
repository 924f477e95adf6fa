import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/model_factory.py


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (model dir, transformers model): one random tiny model per supported family."""
    from model_factory import ARCHS, build

    root = tmp_path_factory.mktemp("models")
    return {arch: (root / arch, build(arch, root / arch)) for arch in ARCHS}
