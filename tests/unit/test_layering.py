"""The layering contract (pyproject.toml [tool.importlinter]) holds, and it is live: an import of the KV
arena added to the model layers breaks it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is a dev dependency (make setup)")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    # a fresh cache directory: a stale graph must not decide the answer
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)})


def test_the_package_keeps_its_layering_contract():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_an_arena_import_in_the_model_layers_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "flashx_batch", tmp_path / "flashx_batch",
                    ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    decoder = tmp_path / "flashx_batch" / "models" / "decoder.py"
    decoder.write_text(decoder.read_text() + "\nfrom flashx_batch.kvcache.arena import KVArena  # noqa: E402,F401\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "Model layers get cache views, never the KV arena BROKEN" in " ".join(result.stdout.split())
    assert "flashx_batch.models.decoder -> flashx_batch.kvcache.arena" in result.stdout
