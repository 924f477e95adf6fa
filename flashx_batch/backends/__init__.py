"""Backend registry: `get_backend("auto" | "cpu" | "cuda" | "rocm" | "npu" | "onnx")`.

Called by `runtime.engine` when an engine starts, by `runtime.onnx_runner`, by the Ray runner (for
`ray_options`, and `resolve_for_ray` to decide `auto` by what the cluster offers), by the benchmarks
(`for_device`) and by `doctor`'s probe subprocess.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from flashx_batch.backends.base import Backend, GraphReplay, ray_accelerator_ids
from flashx_batch.backends.cpu import CpuBackend
from flashx_batch.backends.cuda import CudaBackend
from flashx_batch.backends.npu import NpuBackend
from flashx_batch.backends.onnx import OnnxBackend
from flashx_batch.backends.rocm import RocmBackend
from flashx_batch.errors import ConfigError

BACKENDS: dict[str, type[Backend]] = {
    "cpu": CpuBackend, "cuda": CudaBackend, "rocm": RocmBackend, "npu": NpuBackend, "onnx": OnnxBackend,
}
_TRAITS: dict[str, type[Backend]] = {}  # device type -> `device_traits`' answer
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


def cluster_offers(options: Mapping[str, Any], resources: Mapping[str, float]) -> bool:
    """Whether a Ray cluster with `resources` (`ray.cluster_resources()`) can place one actor with
    these `ray_options` (GPUs and custom resources; CPUs are the executor's to size)."""
    needed = {"GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    return all(resources.get(key, 0) >= amount for key, amount in needed.items() if amount)


def resolve_for_ray(name: str, resources: Mapping[str, float], extra_resources: Mapping[str, float] | None,
                    ask_worker: Callable[[dict[str, Any]], str | None]) -> str:
    """The backend Ray actors run: `auto` decided by what the cluster offers, not by the driver's own
    devices (a CPU-only head node may drive a GPU cluster); other names pass through.

    The candidates are the backends, in `AUTO_ORDER`, whose one-actor request (`ray_options` with the
    executor's `extra_resources`) the cluster can place. Resources alone cannot tell every kind apart
    (a ROCm GPU and an NVIDIA one are both `GPU`; a DCU Ray does not detect is only a custom
    resource), so unless cpu is the sole candidate, `ask_worker(options)` runs `resolve_name("auto")`
    on a worker placed with the first candidate's options, and its answer wins (a kind the cluster
    cannot place is then refused by the caller's resource check). When it gives no answer (None: not
    scheduled in time) the first candidate is taken.
    """
    if name != "auto":
        return name
    candidates = [n for n in AUTO_ORDER if cluster_offers(BACKENDS[n]().ray_options(extra_resources), resources)]
    if not candidates or candidates == ["cpu"]:
        return "cpu"
    answer = ask_worker(BACKENDS[candidates[0]]().ray_options(extra_resources))
    return answer if answer is not None else candidates[0]


def for_device(device: torch.device | str) -> Backend:
    """The available backend whose tensors live on `device` (`cuda` is the cuda or the rocm backend,
    whichever this torch is built for): what a benchmark holding only a device synchronizes with."""
    kind = str(device).split(":", 1)[0]  # "npu:0" does not parse as a torch.device before torch_npu is imported
    for name in AUTO_ORDER:
        if BACKENDS[name].device_type == kind and BACKENDS[name].is_available():
            return BACKENDS[name]()
    raise ConfigError(f"no available backend runs on device {str(device)!r}; "
                      "run `python -m flashx_batch.doctor` to see why.")


def device_traits(device: torch.device | str) -> type[Backend]:
    """The backend class whose tensors live on `device`'s type: what the model and quantization layers
    ask about the device a tensor is on (`host_kernels`, `int8_kernel`, `int4_kernel`) instead of
    comparing device-type strings. A `cuda` device is the cuda backend's (a ROCm build's too: its
    kernels are probed before use); a type no backend claims gets the base class's answers (no host
    kernels, no packed kernels)."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    traits = _TRAITS.get(kind)
    if traits is None:  # asked per layer and step (`on_host`): looked up once per device type
        traits = _TRAITS[kind] = next((c for c in BACKENDS.values() if c.device_type == kind and c.torch_runtime),
                                      Backend)
    return traits


def on_host(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives where the host kernels run (numba, oneDNN packing, the fused int8 step)."""
    return device_traits(tensor.device).host_kernels


def resolved_run(name: str, dtype: str) -> str:
    """`backend/dtype` as an engine on this host runs `runtime.backend=name` with `model.dtype=dtype`:
    `auto` resolved here, and a dtype of `auto` as the backend's default on this host's device (a
    property on accelerators: bfloat16 where the device has it). ConfigError where the backend cannot
    run here (`get_backend`)."""
    backend = get_backend(name)
    chosen = str(backend.default_dtype).removeprefix("torch.") if dtype == "auto" else dtype
    return f"{backend.name}/{chosen}"


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


__all__ = ["Backend", "BACKENDS", "AUTO_ORDER", "GraphReplay", "check_known", "cluster_offers", "device_traits",
           "for_device", "get_backend", "on_host", "resolved_run", "ray_accelerator_ids", "resolve_for_ray",
           "resolve_name"]
