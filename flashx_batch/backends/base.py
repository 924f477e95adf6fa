"""The device seam. Only this package knows which accelerator it is on.

A backend is a small class with declarative attributes (vLLM-platform style) and a few hooks.
Who calls what:
- `runtime.engine` asks for `device()`, `default_dtype`, `supported_dtypes`, `synchronize()`;
- `runner.ray_executor` asks `ray_options()` how to pin one actor to one device;
- a Ray actor asks `assigned_device_index()` which local device is its own;
- `doctor` (in a probe subprocess) and `get_backend("auto")` call `is_available()` and `describe()`;
- `runtime.decode_graphs` asks `capture_graph()` for a replayable decode step (where `supports_graphs`);
- benchmarks ask `synchronize()` and `device_name()` (through `backends.for_device`).

`is_available()` must never raise: it runs on machines where the vendor stack is half-installed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch

log = logging.getLogger(__name__)


def parse_visible_devices(value: str | None) -> list[str] | None:
    """`CUDA_VISIBLE_DEVICES`-style value -> list of ids; None when unset (everything visible)."""
    if value is None:
        return None
    value = value.strip()
    if value in ("", "NoDevFiles"):  # Ray writes NoDevFiles when an actor gets no device
        return []
    return [part.strip() for part in value.split(",") if part.strip()]


def local_index_for(accelerator_id: str, visible: list[str] | None) -> int:
    """Map a Ray accelerator id (a physical id) to the torch device index this process sees.

    Ray normally narrows the visible-devices variable to the actor's own device, which is then
    index 0. With `RAY_EXPERIMENTAL_NOSET_*` it leaves the variable alone, so the physical id must
    be found in whatever the variable already lists (or used as is when nothing restricts it).
    """
    if visible is None:
        return int(accelerator_id)
    if accelerator_id in visible:
        return visible.index(accelerator_id)
    raise RuntimeError(f"Ray assigned device {accelerator_id}, which is not in the visible devices {visible}")


T = TypeVar("T")


class GraphReplay(Protocol):
    """A captured device graph: `replay()` reruns the captured work on the same buffers."""

    def replay(self) -> None: ...


class Backend:
    name: str = "base"
    device_type: str = "cpu"  # torch device type
    ray_num_gpus: float = 0.0  # cuda / rocm actors ask Ray for one GPU
    ray_resource: str | None = None  # npu actors ask for a custom resource, e.g. {"NPU": 1}
    ray_accelerator_key: str | None = None  # key of ray.get_runtime_context().get_accelerator_ids()
    visible_devices_env: str | None = None  # the variable Ray narrows per actor
    ray_noset_env: str | None = None  # RAY_EXPERIMENTAL_NOSET_<var>: Ray leaves `visible_devices_env` alone
    default_dtype: torch.dtype = torch.bfloat16
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    supports_graphs: bool = False  # CUDA graphs / torch.compile with static shapes
    # decode attention in two calls when that saves reading this many bytes of one layer's cache
    # (`runtime.layouts.stripes.attention_groups`); None: one call always (measured on CPU only; on a GPU a
    # kernel launch weighs more against the bytes it reads)
    attention_split_min_bytes: int | None = None
    # growing refilled batches keep each row in a KV extent of its own (`runtime.layouts.extents.ExtentLayout`):
    # attention then runs once per run of rows, which a CPU pays in microseconds and a GPU in launches
    prefers_row_extents: bool = False
    # tensors live in host memory and the numba kernels serve them (`backends.cpu_decode`, the fused int8
    # decode step): decode reads rows in extents in one call, logits are computed in cache-sized chunks
    host_kernels: bool = False
    torch_runtime: bool = True  # False: the torch `Engine` cannot run on it (the ONNX Runtime path)
    # weight-only int4 through torch's packed kernel on this device (`quant.linear`, probed before use);
    # None: dequantize per call
    int4_kernel: str | None = None
    # the collective library tensor-parallel ranks talk through (`backends.distributed`); None: no tensor parallelism
    collective: str | None = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return False

    @classmethod
    def int8_kernel(cls, dtype: torch.dtype) -> str:
        """The `quant.linear` kernel int8 weights run with activations in `dtype` on this device (probed
        before use): here none, so each call dequantizes."""
        return "dequant"

    def device_string(self, index: int = 0) -> str:
        return f"{self.device_type}:{index}"

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_string(index))

    def set_device(self, index: int = 0) -> None:
        """Make `index` the current device of this process (no-op where devices are implicit)."""

    def prepare_model(self, model: torch.nn.Module) -> int:
        """Backend-specific weight layouts once the model is loaded (CPU: oneDNN-packed linears).
        Returns how many weights it re-laid; default none."""
        return 0

    def synchronize(self) -> None:
        """Wait for queued device work, so wall-clock timings are honest."""

    def setup_threads(self, num_threads: int) -> None:
        """Host threads for this process's kernels (CPU: intra-op threads, `EngineOptions.cpu_threads`).
        Accelerator backends leave torch's default alone."""

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the current device; host memory for CPU-like backends."""
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return avail * page, pages * page

    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device."""

    def capture_graph(self, fn: Callable[[], T], pool: Any = None) -> tuple[GraphReplay, T, Any]:
        """Warm `fn` up, then capture one call of it as a device graph -> (the graph, what `fn`
        returned while captured, the memory pool). Each `replay()` reruns the captured work on the
        same input and output buffers, so the output returned here holds the latest replay's result.
        Pass the returned pool to the next capture for graphs that share memory (None: a new pool).
        Backends without graphs (`supports_graphs` False) raise NotImplementedError (a RuntimeError)."""
        raise NotImplementedError(f"the {self.name} backend captures no device graphs")

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int = 0) -> str:
        return self.device_type

    # ---- visible devices and Ray pinning ----------------------------------------------------
    def visible_devices(self, environ: Mapping[str, str] | None = None) -> list[str] | None:
        """Ids listed in this backend's visible-devices variable; None when it is unset."""
        env = os.environ if environ is None else environ
        return parse_visible_devices(env.get(self.visible_devices_env)) if self.visible_devices_env else None

    def ray_sets_visible_devices(self, environ: Mapping[str, str] | None = None) -> bool:
        """False when `RAY_EXPERIMENTAL_NOSET_<var>` tells Ray not to narrow the variable per actor."""
        env = os.environ if environ is None else environ
        if not self.ray_noset_env:
            return True
        return env.get(self.ray_noset_env, "").strip().lower() not in ("1", "true", "yes")

    def assigned_device_index(self, accelerator_ids: Mapping[str, list[str]] | None = None,
                              environ: Mapping[str, str] | None = None) -> int:
        """The local device index this process should use (called by a Ray actor before loading).

        `accelerator_ids` is `ray.get_runtime_context().get_accelerator_ids()`; None outside Ray.
        """
        ids = (accelerator_ids or {}).get(self.ray_accelerator_key or "", [])
        if not ids or self.ray_sets_visible_devices(environ):
            return 0  # outside Ray, or Ray already narrowed the variable to this actor's device
        return local_index_for(str(ids[0]), self.visible_devices(environ))

    def ray_options(self, extra_resources: Mapping[str, float] | None = None) -> dict[str, Any]:
        """Actor options that pin one actor to one device of this kind (+ `executor.resources`)."""
        options: dict[str, Any] = {}
        resources = {self.ray_resource: 1} if self.ray_resource else {}
        if self.ray_num_gpus:
            options["num_gpus"] = self.ray_num_gpus
        resources.update(extra_resources or {})
        if resources:
            options["resources"] = resources
        return options

    def describe(self) -> dict[str, Any]:
        """Facts for `doctor` and the job log: never raises, best effort."""
        facts: dict[str, Any] = {"name": self.name, "device_type": self.device_type,
                                 "default_dtype": str(self.default_dtype).removeprefix("torch."),
                                 "visible_devices_env": self.visible_devices_env}
        try:
            facts["device_count"] = self.device_count()
            facts["devices"] = [self.device_name(i) for i in range(facts["device_count"])]
            if self.torch_runtime:
                facts["weight_formats"] = self.weight_formats()
        except Exception as exc:  # a half-installed stack: report, do not crash the report
            facts["error"] = f"{type(exc).__name__}: {exc}"
        return facts

    def fp8_matmul(self) -> bool:
        """Whether this device multiplies FP8 matrices in hardware (none here)."""
        return False

    def weight_formats(self) -> dict[str, str]:
        """What each weight format runs as on this device (`doctor`): the `quant.linear` kernel, or a
        dequantization per matmul. The kernels are still probed before use."""
        fp8 = "dequantized per matmul" + (" (the device has FP8 matmuls; not used yet)" if self.fp8_matmul() else "")
        return {"int8, float32 activations": self.int8_kernel(torch.float32),
                "int8, bfloat16 activations": self.int8_kernel(torch.bfloat16),
                "int4 (precision maps), bfloat16 activations": self.int4_kernel or "dequant",
                "int4 checkpoints (GPTQ, AWQ, compressed-tensors)": "dequantized per matmul",
                "fp8 checkpoints": fp8}


def ray_accelerator_ids() -> dict[str, list[str]] | None:
    """Inside a Ray actor: the accelerator ids Ray assigned to it (`assigned_device_index` maps them
    to a local device); elsewhere None."""
    import sys

    ray = sys.modules.get("ray")  # never import Ray just to ask: the local path must not need it
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_accelerator_ids()
