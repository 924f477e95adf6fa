"""Backend registry: `get_backend("auto" | "cpu" | "cuda" | "rocm" | "npu" | "onnx")`.

Called by `runtime.engine` when an engine starts, by `onnx.OnnxEngine`, by the Ray runner (for
`ray_options`) and by `doctor`'s probe subprocess.
"""

from __future__ import annotations

from flashx_batch.backends.base import Backend
from flashx_batch.backends.cpu import CpuBackend
from flashx_batch.backends.cuda import CudaBackend
from flashx_batch.backends.npu import NpuBackend
from flashx_batch.backends.onnx import OnnxBackend
from flashx_batch.backends.rocm import RocmBackend
from flashx_batch.errors import ConfigError

BACKENDS: dict[str, type[Backend]] = {
    "cpu": CpuBackend, "cuda": CudaBackend, "rocm": RocmBackend, "npu": NpuBackend, "onnx": OnnxBackend,
}
# `onnx` is never chosen by `auto`: it is an explicit choice for hosts without a HIP build of torch.
AUTO_ORDER = ("npu", "rocm", "cuda", "cpu")

# What to do when a requested backend is not available (doctor prints the same advice, in detail).
_UNAVAILABLE_HINT = {
    "npu": "install torch_npu matching your torch and source the CANN set_env.sh",
    "cuda": "install a CUDA build of torch and check `nvidia-smi`",
    "rocm": "install a ROCm (HIP) build of torch, or use runtime.backend=onnx with onnxruntime-rocm",
    "onnx": "pip install 'flashx-batch[rocm]' (onnxruntime-rocm) or onnxruntime",
}


def resolve_name(name: str = "auto") -> str:
    """`auto` -> the first available of npu → rocm → cuda → cpu; other names pass through."""
    if name == "auto":
        return next(n for n in AUTO_ORDER if BACKENDS[n].is_available())
    return name


def check_known(name: str) -> None:
    """ConfigError unless `name` is `auto` or a registered backend (available here or not)."""
    if name != "auto" and name not in BACKENDS:
        raise ConfigError(f"runtime.backend={name!r} is unknown; choose one of auto, {', '.join(BACKENDS)}.")


def get_backend(name: str = "auto") -> Backend:
    """Resolve a backend name to an instance; raises `ConfigError` naming the fix when it cannot run."""
    check_known(name)
    name = resolve_name(name)
    backend = BACKENDS[name]
    if not backend.is_available():
        raise ConfigError(
            f"runtime.backend={name} is not available on this machine ({_UNAVAILABLE_HINT.get(name, '')}); "
            "run `python -m flashx_batch.doctor runtime.backend=" + name + "` to see why, or use runtime.backend=auto."
        )
    return backend()


__all__ = ["Backend", "BACKENDS", "AUTO_ORDER", "check_known", "get_backend", "resolve_name"]
