"""`doctor` against real traps, each made in a subprocess so the test process itself stays healthy.

The torch_npu trap uses the real wheel (downloaded once into ~/.cache/flashx-batch/test-wheels, or
FLASHX_TORCH_NPU_WHEEL) installed into a temporary directory that only the doctor's PYTHONPATH sees.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashx_batch import doctor

REPO = Path(__file__).resolve().parents[2]
DOCTOR = REPO / "flashx_batch" / "doctor.py"
TORCH_MM = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    return {**env, **extra}


def run_doctor(*args: str, as_module: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Run the doctor the way a user does: as a file, or with `python -m` when `as_module`."""
    entry = ["-m", "flashx_batch.doctor"] if as_module else [str(DOCTOR)]
    return subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=_clean_env(**env))


@pytest.fixture(scope="session")
def torch_npu_target(tmp_path_factory) -> Path:
    """torch_npu without CANN, in a directory to put on PYTHONPATH; no network. By default a stand-in built here
    that works the way the real wheel does: a distribution of this torch's version registering the
    `torch.backends` entry point torch auto-loads on import, whose import fails loading CANN's libhccl.so. With
    FLASHX_TORCH_NPU_WHEEL=path/to/torch_npu.whl, that real wheel instead (installed with --no-deps)."""
    target = tmp_path_factory.mktemp("torch_npu_site")
    wheel = os.environ.get("FLASHX_TORCH_NPU_WHEEL")
    if wheel:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                               "--target", str(target), wheel], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return target
    version = f"{TORCH_MM}.0"
    (target / "torch_npu").mkdir()
    (target / "torch_npu" / "__init__.py").write_text(
        "import ctypes\n"
        "__version__ = " + repr(version) + "\n"
        "ctypes.CDLL('libhccl.so')  # what the real package's native module needs first: absent without CANN\n"
        "def _autoload():\n    pass\n")
    info = target / f"torch_npu-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    (info / "RECORD").write_text("")
    return target


@pytest.fixture
def fake_old_torch_npu(tmp_path) -> Path:
    """A torch_npu 2.1.0 distribution (metadata + importable package, no autoload entry point)."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text('__version__ = "2.1.0"\n')
    info = tmp_path / "torch_npu-2.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.1.0\n")
    return tmp_path


def test_healthy_cpu_host_exits_0_and_reports_the_stack():
    out = run_doctor("runtime.backend=cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"torch                 {torch.__version__}" in out.stdout
    assert "No known traps found." in out.stdout and "CAN run here (exit 0)" in out.stdout


def test_unavailable_backend_exits_1_with_fix_and_json_mode():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present, so cuda is available")
    out = run_doctor("runtime.backend=cuda", "--json")
    assert out.returncode == 1
    report = json.loads(out.stdout)
    (finding,) = [f for f in report["findings"] if f["code"] == "backend_unavailable"]
    assert "runtime.backend=cuda cannot run here" in finding["message"]
    assert any("nvidia-smi" in fix for fix in finding["fix"]) and report["exit_code"] == 1


def test_bad_argument_exits_2():
    assert doctor.main(["runtime.backend=tpu"]) == 2


def test_real_torch_npu_without_cann_is_recognised(torch_npu_target):
    # the trap is real: plain `import torch` dies in this environment
    broken = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=300,
                            env=_clean_env(PYTHONPATH=str(torch_npu_target)))
    assert broken.returncode != 0 and "libhccl.so" in broken.stderr
    out = run_doctor("runtime.backend=cpu", PYTHONPATH=str(torch_npu_target))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[ERROR] torch_npu_without_cann" in out.stdout and "libhccl.so" in out.stdout
    assert "with TORCH_DEVICE_BACKEND_AUTOLOAD=0 torch imports fine" in out.stdout
    assert "fix: source /usr/local/Ascend/ascend-toolkit/set_env.sh" in out.stdout
    assert "fix: export TORCH_DEVICE_BACKEND_AUTOLOAD=0" in out.stdout


def test_module_entry_survives_torch_npu_without_cann(torch_npu_target):
    out = run_doctor("runtime.backend=cpu", as_module=True, PYTHONPATH=f"{torch_npu_target}:{REPO}")
    assert "[ERROR] torch_npu_without_cann" in out.stdout


def test_torch_npu_version_mismatch(fake_old_torch_npu):
    major, minor = TORCH_MM.split(".")
    out = run_doctor("runtime.backend=npu", PYTHONPATH=str(fake_old_torch_npu))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[ERROR] torch_npu_version_mismatch" in out.stdout
    assert f"fix: pip install 'torch_npu>={TORCH_MM},<{major}.{int(minor) + 1}'" in out.stdout
    assert "fix: pip install 'torch==2.1.*'" in out.stdout
    # the same mismatch does not stop a CPU job: reported as a warning, exit 0
    out = run_doctor("runtime.backend=cpu", PYTHONPATH=str(fake_old_torch_npu))
    assert out.returncode == 0 and "[WARNING] torch_npu_version_mismatch" in out.stdout


def test_rocr_visible_devices_under_ray():
    out = run_doctor("runtime.backend=cpu", ROCR_VISIBLE_DEVICES="0,1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[ERROR] rocr_visible_devices_under_ray" in out.stdout
    assert "Please use HIP_VISIBLE_DEVICES instead of ROCR_VISIBLE_DEVICES" in out.stdout  # Ray's own words
    assert "fix: export HIP_VISIBLE_DEVICES=0,1; unset ROCR_VISIBLE_DEVICES" in out.stdout
    assert run_doctor("runtime.backend=cpu", "executor.kind=local", ROCR_VISIBLE_DEVICES="0,1").returncode == 0


def test_cuda_build_without_gpu_is_named():
    torch_info = {"ok": True, "version": "2.13.0+cu128", "cuda": "12.8", "hip": None, "cuda_available": False}
    findings = doctor.find_traps("cuda", "ray", {"torch": "2.13.0+cu128"}, torch_info, None, {},
                                 {"nvidia": [], "kfd": False, "davinci": []}, {})
    (f,) = findings
    assert f.code == "cuda_build_without_gpu" and f.severity == "error"
    assert any("download.pytorch.org/whl/cpu" in fix for fix in f.fix)
    findings = doctor.find_traps("cpu", "ray", {"torch": "2.13.0+cu128"}, torch_info, None, {},
                                 {"nvidia": [], "kfd": False, "davinci": []}, {})
    assert [f.severity for f in findings] == ["warning"]
