"""Backend registry: `get_backend("auto" | "cpu" | "cuda" | "rocm" | "npu")`."""

from __future__ import annotations

from flashx_batch.backends.base import Backend
from flashx_batch.backends.cpu import CpuBackend
from flashx_batch.backends.cuda import CudaBackend
from flashx_batch.backends.npu import NpuBackend
from flashx_batch.backends.rocm import RocmBackend
from flashx_batch.errors import ConfigError

BACKENDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "rocm": RocmBackend, "npu": NpuBackend}
AUTO_ORDER = ("npu", "rocm", "cuda", "cpu")


def get_backend(name: str = "auto") -> Backend:
    """Resolve a backend name; `auto` takes the first available of npu → rocm → cuda → cpu."""
    if name == "auto":
        return next(BACKENDS[n]() for n in AUTO_ORDER if BACKENDS[n].is_available())
    if name not in BACKENDS:
        raise ConfigError(f"runtime.backend={name!r} is unknown; choose one of auto, {', '.join(BACKENDS)}.")
    backend = BACKENDS[name]
    if not backend.is_available():
        raise ConfigError(
            f"runtime.backend={name} is not available on this machine; "
            "run `python -m flashx_batch.doctor` to see why, or use runtime.backend=auto."
        )
    return backend()


__all__ = ["Backend", "get_backend", "BACKENDS"]
