"""`python -m flashx_batch.doctor [runtime.backend=…] [executor.kind=…] [--json]`

Says what is installed and visible (torch and its build, CUDA / HIP / CANN versions, torch_npu,
onnxruntime providers, visible-device variables, Ray's detected accelerators), names the known
traps with their exact fixes, and exits 0 when the configured backend can run here, 1 when it
cannot, 2 on a bad argument.

Who calls it: users, before a job and when a job fails with "backend not available"; the
backend error messages point here. This module imports only the standard library: a broken
torch stack (torch_npu without CANN makes *every* `import torch` fail) must not crash the tool
that diagnoses it, so all torch, Ray and onnxruntime probes run in subprocesses.
It runs as a file too (`python flashx_batch/doctor.py`), which never imports the package.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

BACKEND_NAMES = ("auto", "cpu", "cuda", "rocm", "npu", "onnx")
AUTO_ORDER = ("npu", "rocm", "cuda", "cpu")  # keep in step with flashx_batch.backends.AUTO_ORDER
VISIBLE_DEVICE_VARS = (
    "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", "TORCH_DEVICE_BACKEND_AUTOLOAD",
)
DISTRIBUTIONS = ("torch", "torch_npu", "onnxruntime", "onnxruntime-rocm", "onnxruntime-migraphx",
                 "onnxruntime-gpu", "ray", "transformers")
CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
# Shared libraries that only the Ascend CANN toolkit provides; torch_npu links against them.
CANN_LIBS = re.compile(r"lib(hccl|ascendcl|acl_op_compiler|ge_runner|graph|runtime|opapi|hccl_alg)\w*\.so")
PROBE_TIMEOUT_S = 180
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
PACKAGE_DIR = str(Path(__file__).resolve().parent)

# Runs in a subprocess: imports torch (which may fail), then asks every backend about itself.
_TORCH_PROBE = r"""
import json, sys, traceback
sys.path = [p for p in sys.path if p != PACKAGE_DIR] + [PACKAGE_PARENT]
out = {"ok": False}
try:
    import torch
    out.update(ok=True, version=torch.__version__, cuda=torch.version.cuda,
               hip=getattr(torch.version, "hip", None))
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["cuda_device_count"] = torch.cuda.device_count()
    except Exception as exc:
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch_npu
        out["torch_npu"] = getattr(torch_npu, "__version__", "?")
    except ModuleNotFoundError:
        pass
    except Exception as exc:
        out["torch_npu_error"] = "".join(traceback.format_exception(exc))[-3000:]
    try:
        from flashx_batch.backends import BACKENDS
        out["backends"] = {}
        for name, cls in BACKENDS.items():
            available = cls.is_available()
            facts = cls().describe() if available else {}
            out["backends"][name] = {"available": available, **facts}
    except Exception as exc:
        out["backends_error"] = "".join(traceback.format_exception(exc))[-3000:]
except BaseException as exc:
    out["error"] = "".join(traceback.format_exception(exc))[-6000:]
print("\n@@PROBE@@" + json.dumps(out, default=str))
"""

# Runs in a subprocess: Ray's accelerator detection (no cluster started) and onnxruntime.
_STACK_PROBE = r"""
import json, traceback
out = {}
try:
    import onnxruntime as ort
    out["onnxruntime"] = {"version": ort.__version__, "providers": ort.get_available_providers()}
except ModuleNotFoundError:
    pass
except Exception as exc:
    out["onnxruntime"] = {"error": f"{type(exc).__name__}: {exc}"}
try:
    import ray
    from ray._private import accelerators
    found, errors = {}, {}
    for manager in accelerators.get_all_accelerator_managers():
        try:
            count = manager.get_current_node_num_accelerators()
            env_var = manager.get_visible_accelerator_ids_env_var()
            manager.get_current_process_visible_accelerator_ids()
            if count:
                found[manager.get_resource_name()] = {"count": count, "env": env_var}
        except Exception as exc:
            errors[manager.__name__] = f"{type(exc).__name__}: {exc}"
    out["ray"] = {"version": ray.__version__, "accelerators": found, "errors": errors}
except ModuleNotFoundError:
    pass
except Exception as exc:
    out["ray"] = {"error": f"{type(exc).__name__}: {exc}"}
print("\n@@PROBE@@" + json.dumps(out, default=str))
"""


@dataclass
class Finding:
    """One known trap: what is wrong, how bad, and the exact commands that fix it."""

    code: str
    severity: str  # "error" (the configured backend cannot run) | "warning"
    message: str
    fix: list[str] = field(default_factory=list)


@dataclass
class Report:
    backend: str
    resolved: str | None
    executor: str
    installed: dict[str, str | None]
    versions: dict[str, str | None]
    devices: dict[str, Any]
    environment: dict[str, str]
    torch: dict[str, Any]
    stack: dict[str, Any]
    findings: list[Finding]
    can_run: bool

    @property
    def exit_code(self) -> int:
        return 0 if self.can_run and not any(f.severity == "error" for f in self.findings) else 1


# ---- probes -------------------------------------------------------------------------------------
def run_probe(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run probe code in a fresh interpreter with this process's environment; never raises."""
    code = code.replace("PACKAGE_DIR", repr(PACKAGE_DIR)).replace("PACKAGE_PARENT", repr(PACKAGE_PARENT))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"probe timed out after {PROBE_TIMEOUT_S}s"}
    marker = done.stdout.rfind("@@PROBE@@")
    if marker < 0:  # died before printing (a segfault in a vendor library, an import-time abort)
        return {"ok": False, "error": f"probe exited {done.returncode}: {(done.stderr or done.stdout)[-6000:]}"}
    return json.loads(done.stdout[marker + len("@@PROBE@@"):])


def installed_versions() -> dict[str, str | None]:
    """Distribution versions from metadata: reading metadata imports nothing, so it cannot fail like torch."""
    versions: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _read_version_file(path: Path, key: str = "version") -> str | None:
    try:
        for line in path.read_text(errors="replace").splitlines():
            name, _, value = line.partition("=")
            if name.strip().lower() == key:
                return value.strip()
        return path.read_text(errors="replace").strip().splitlines()[0] or None
    except (OSError, IndexError):
        return None


def stack_versions(environ: dict[str, str]) -> dict[str, str | None]:
    """Vendor toolkit versions read from their install trees (CANN, ROCm / DTK, NVIDIA driver)."""
    cann_home = Path(environ.get("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest"))
    cann = None
    for candidate in (cann_home / "version.cfg", *sorted(cann_home.glob("*/ascend_toolkit_install.info"))):
        if candidate.is_file():
            cann = _read_version_file(candidate)
            break
    rocm_root = Path(environ.get("ROCM_PATH", "/opt/rocm"))
    rocm = _read_version_file(rocm_root / ".info" / "version") if (rocm_root / ".info" / "version").is_file() else None
    nvidia = None
    driver = Path("/proc/driver/nvidia/version")
    if driver.is_file():
        match = re.search(r"Kernel Module\s+([\d.]+)", driver.read_text(errors="replace"))
        nvidia = match.group(1) if match else "present"
    return {"cann": cann, "rocm": rocm, "dtk": "present" if Path("/opt/dtk").exists() else None,
            "nvidia_driver": nvidia}


def device_nodes() -> dict[str, Any]:
    """Which accelerator device files exist: a cheap "is there hardware at all" signal."""
    dev = Path("/dev")
    return {"nvidia": sorted(p.name for p in dev.glob("nvidia[0-9]*")), "kfd": (dev / "kfd").exists(),
            "davinci": sorted(p.name for p in dev.glob("davinci[0-9]*"))}


# ---- traps --------------------------------------------------------------------------------------
def _major_minor(version: str | None) -> str | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{match.group(1)}.{match.group(2)}" if match else None


def find_traps(backend: str, executor: str, installed: dict[str, str | None], torch_info: dict[str, Any],
               autoload_off: dict[str, Any] | None, stack: dict[str, Any], devices: dict[str, Any],
               environ: dict[str, str]) -> list[Finding]:
    """Every known trap that applies, most fundamental first. Pure: tests feed it fake probe results."""
    findings: list[Finding] = []
    error_text = (torch_info.get("error") or "") + (torch_info.get("torch_npu_error") or "")
    npu_wanted = backend in ("npu", "auto")

    cann_lib = CANN_LIBS.search(error_text)
    if cann_lib and installed.get("torch_npu"):
        escape = ("with TORCH_DEVICE_BACKEND_AUTOLOAD=0 torch imports fine, so torch_npu is the only culprit"
                  if autoload_off and autoload_off.get("ok") else "")
        where = "every `import torch` fails" if not torch_info.get("ok") else "`import torch_npu` fails"
        findings.append(Finding(
            "torch_npu_without_cann", "error" if not torch_info.get("ok") or backend == "npu" else "warning",
            f"torch_npu {installed['torch_npu']} is installed but the Ascend CANN libraries are not loadable "
            f"({cann_lib.group(0)}: cannot open shared object file), so {where}"
            + (f"; {escape}" if escape else "") + ".",
            [f"source {CANN_SET_ENV}    # an Ascend host with CANN installed: put its libraries on the path",
             "export TORCH_DEVICE_BACKEND_AUTOLOAD=0    # not an NPU host: stop torch auto-loading torch_npu",
             "pip uninstall -y torch_npu    # or remove it from this environment for good"]))

    torch_mm, npu_mm = _major_minor(installed.get("torch")), _major_minor(installed.get("torch_npu"))
    if torch_mm and npu_mm and torch_mm != npu_mm:
        nxt = f"{torch_mm.split('.')[0]}.{int(torch_mm.split('.')[1]) + 1}"
        findings.append(Finding(
            "torch_npu_version_mismatch", "error" if npu_wanted else "warning",
            f"torch_npu {installed['torch_npu']} is built for torch {npu_mm}.x but torch {installed['torch']} "
            "is installed; torch_npu only loads against the torch major.minor it was built for.",
            [f"pip install 'torch_npu>={torch_mm},<{nxt}'    # keep torch {installed['torch']}",
             f"pip install 'torch=={npu_mm}.*'    # or keep torch_npu {installed['torch_npu']}"]))

    if torch_info.get("ok") and torch_info.get("cuda") and not torch_info.get("cuda_available") \
            and not devices.get("nvidia"):
        findings.append(Finding(
            "cuda_build_without_gpu", "error" if backend == "cuda" else "warning",
            f"torch {torch_info.get('version')} is a CUDA {torch_info.get('cuda')} build but this machine has no "
            "NVIDIA GPU (no /dev/nvidia*): it works on CPU but carries ~2 GB of unused CUDA libraries, and "
            "runtime.backend=cuda cannot run.",
            ["pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cpu",
             "python -m flashx_batch conf=… runtime.backend=cpu    # or simply run on CPU"]))

    if environ.get("ROCR_VISIBLE_DEVICES") is not None and environ.get("HIP_VISIBLE_DEVICES") is None:
        ray_errors = " ".join((stack.get("ray") or {}).get("errors", {}).values())
        confirmed = " (Ray here says: " + ray_errors + ")" if "ROCR_VISIBLE_DEVICES" in ray_errors else ""
        findings.append(Finding(
            "rocr_visible_devices_under_ray", "error" if executor == "ray" else "warning",
            f"ROCR_VISIBLE_DEVICES={environ['ROCR_VISIBLE_DEVICES']} is set and HIP_VISIBLE_DEVICES is not: "
            f"Ray refuses to detect AMD GPUs / DCUs this way{confirmed}.",
            [f"export HIP_VISIBLE_DEVICES={environ['ROCR_VISIBLE_DEVICES']}; unset ROCR_VISIBLE_DEVICES"]))

    if environ.get("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES") and executor == "ray" and npu_wanted:
        findings.append(Finding(
            "ray_noset_ascend_visible_devices", "warning",
            "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES is set: Ray will not narrow "
            "ASCEND_RT_VISIBLE_DEVICES per actor; each actor selects its card from Ray's NPU ids instead.",
            ["unset RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES    # unless every actor must see every card"]))
    return findings


def _unavailable(backend: str, torch_info: dict[str, Any], installed: dict[str, str | None],
                 devices: dict[str, Any]) -> Finding:
    """The `requested backend unavailable` finding, with the fix that fits what is installed."""
    fixes = {
        "npu": [f"pip install 'torch_npu=={_major_minor(installed.get('torch')) or '<torch major.minor>'}.*'",
                f"source {CANN_SET_ENV}", "npu-smi info    # the driver must list the cards"],
        "cuda": ["nvidia-smi    # the driver must list the GPU",
                 "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu128"],
        "rocm": ["pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/rocm6.4",
                 "rocm-smi    # (hy-smi on Hygon DCU) the driver must list the devices",
                 "python -m flashx_batch conf=… runtime.backend=onnx    # no HIP build of torch: ONNX Runtime path"],
        "onnx": ["pip install 'flashx-batch[rocm]'    # onnxruntime-rocm on ROCm hosts",
                 "pip install onnxruntime    # CPU provider elsewhere"],
        "cpu": ["pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cpu"],
    }
    build = "HIP" if torch_info.get("hip") else "CUDA" if torch_info.get("cuda") else "CPU"
    detail = {
        "npu": f"torch_npu {installed.get('torch_npu') or 'is not installed'}; /dev/davinci*: "
               f"{len(devices.get('davinci', []))}",
        "cuda": f"torch is a {build} build; /dev/nvidia*: {len(devices.get('nvidia', []))}",
        "rocm": f"torch is a {build} build; /dev/kfd: {'present' if devices.get('kfd') else 'absent'}",
        "onnx": "onnxruntime is not installed or lists no providers",
        "cpu": "torch does not import",
    }.get(backend, "")
    return Finding("backend_unavailable", "error", f"runtime.backend={backend} cannot run here ({detail}).",
                   fixes.get(backend, []))


def diagnose(backend: str = "auto", executor: str = "ray", environ: dict[str, str] | None = None) -> Report:
    """Run every probe and collect the report (called by `main`; tests call it too)."""
    env = dict(os.environ if environ is None else environ)
    installed = installed_versions()
    torch_info = run_probe(_TORCH_PROBE)
    autoload_off = None
    if not torch_info.get("ok") and installed.get("torch_npu"):
        autoload_off = run_probe(_TORCH_PROBE, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    stack = run_probe(_STACK_PROBE)
    devices = device_nodes()
    findings = find_traps(backend, executor, installed, torch_info, autoload_off, stack, devices, env)

    available = {name: bool(info.get("available")) for name, info in (torch_info.get("backends") or {}).items()}
    if not available and torch_info.get("ok"):
        available = {"cpu": True}  # flashx_batch itself failed to import in the probe: torch alone still runs
    resolved = next((n for n in AUTO_ORDER if available.get(n)), None) if backend == "auto" else backend
    can_run = bool(torch_info.get("ok")) and resolved is not None and available.get(resolved, False)
    if not can_run and torch_info.get("ok"):
        findings.append(_unavailable(resolved or backend, torch_info, installed, devices))
    if not torch_info.get("ok") and not findings:
        last = (torch_info.get("error") or "unknown error").strip().splitlines()
        findings.append(Finding("torch_import_failed", "error", f"`import torch` fails: {last[-1]}",
                                ["pip install --force-reinstall torch    # then rerun the doctor"]))
    env_view = {k: env[k] for k in VISIBLE_DEVICE_VARS if k in env}
    return Report(backend, resolved, executor, installed, stack_versions(env), devices, env_view,
                  torch_info, stack, findings, can_run)


# ---- output -------------------------------------------------------------------------------------
def _torch_line(t: dict[str, Any]) -> str:
    if not t.get("ok"):
        return "import FAILS (see traps)"
    build = f"HIP {t['hip']}" if t.get("hip") else f"CUDA {t['cuda']}" if t.get("cuda") else "CPU"
    gpus = f", {t.get('cuda_device_count', 0)} GPU(s) visible" if t.get("cuda") or t.get("hip") else ""
    return f"{t['version']} ({build} build{gpus})"


def render(report: Report) -> str:
    """The human report (doctor's own output: printing it is its job)."""
    lines = ["flashx-batch doctor", "", "Installed:"]
    lines.append(f"  {'torch':<22}{_torch_line(report.torch)}")
    for name, version in report.installed.items():
        if name != "torch":
            lines.append(f"  {name:<22}{version or '-'}")
    lines.append("Vendor stack:")
    for name, version in report.versions.items():
        lines.append(f"  {name:<22}{version or '-'}")
    nodes = report.devices
    lines.append(f"  {'device files':<22}nvidia={len(nodes['nvidia'])} kfd={'yes' if nodes['kfd'] else 'no'} "
                 f"davinci={len(nodes['davinci'])}")
    ort = report.stack.get("onnxruntime") or {}
    if ort:
        lines.append(f"  {'onnxruntime providers':<22}{', '.join(ort.get('providers', [])) or ort.get('error')}")
    lines.append("Environment:")
    for key, value in report.environment.items():
        lines.append(f"  {key}={value}")
    if not report.environment:
        lines.append("  (no visible-device variables set)")
    ray = report.stack.get("ray") or {}
    if ray:
        accel = ", ".join(f"{k}={v['count']} via {v['env']}" for k, v in ray.get("accelerators", {}).items())
        lines.append(f"Ray {ray.get('version', '?')}: accelerators detected: {accel or 'none (CPU only)'}")
    lines.append("Backends:")
    if not report.torch.get("backends"):
        lines.append("  (not probed: torch or flashx_batch does not import)")
    for name, info in (report.torch.get("backends") or {}).items():
        extra = f"  {info.get('devices')} default {info.get('default_dtype')}" if info.get("available") else ""
        lines.append(f"  {name:<6}{'available' if info.get('available') else '-'}{extra}")
        for fmt, runs in (info.get("weight_formats") or {}).items():
            lines.append(f"        {fmt}: {runs}")
    lines.append("")
    if report.findings:
        lines.append("Traps found:")
        for f in report.findings:
            lines.append(f"  [{f.severity.upper()}] {f.code}: {f.message}")
            lines.extend(f"      fix: {cmd}" for cmd in f.fix)
    else:
        lines.append("No known traps found.")
    target = report.backend if report.backend == report.resolved else f"{report.backend} -> {report.resolved}"
    verdict = "CAN run" if report.exit_code == 0 else "CANNOT run"
    lines.append("")
    lines.append(f"runtime.backend={target}: {verdict} here (exit {report.exit_code}).")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[str, str, bool]:
    """Hydra-style overrides, so the same `runtime.backend=…` a job takes works here."""
    backend, executor, as_json = "auto", "ray", False
    for arg in argv:
        key, _, value = arg.partition("=")
        if arg == "--json":
            as_json = True
        elif key.lstrip("+") == "runtime.backend" and value in BACKEND_NAMES:
            backend = value
        elif key.lstrip("+") == "executor.kind" and value in ("ray", "local"):
            executor = value
        else:
            raise ValueError(f"unknown argument {arg!r}; usage: python -m flashx_batch.doctor "
                             f"[runtime.backend={'|'.join(BACKEND_NAMES)}] [executor.kind=ray|local] [--json]")
    return backend, executor, as_json


def main(argv: list[str] | None = None) -> int:
    try:
        backend, executor, as_json = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    report = diagnose(backend, executor)
    if as_json:
        print(json.dumps({**asdict(report), "exit_code": report.exit_code}, indent=2, default=str))
    else:
        print(render(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
