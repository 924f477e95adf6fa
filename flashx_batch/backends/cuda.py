"""NVIDIA CUDA backend (torch built for CUDA, not HIP). `RocmBackend` reuses its hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashx_batch.backends.base import Backend, T


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    ray_num_gpus = 1.0
    ray_accelerator_key = "GPU"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_noset_env = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
    supports_graphs = True
    collective = "nccl"  # RCCL under the same name on ROCm builds of torch
    int4_kernel = "int4pack_mm_cuda"

    @classmethod
    def int8_kernel(cls, dtype: torch.dtype) -> str:
        return "int8pack_mm" if dtype in (torch.bfloat16, torch.float16) else "dequant"

    def fp8_matmul(self) -> bool:
        # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards; ROCm's MI300 reports its own gfx version
        return torch.version.hip is None and torch.cuda.get_device_capability(0) >= (8, 9)

    @classmethod
    def is_available(cls) -> bool:
        try:
            return torch.version.hip is None and torch.cuda.is_available()
        except Exception:  # a broken driver must not take `auto` down
            return False

    @property
    def default_dtype(self) -> torch.dtype:  # type: ignore[override]
        # bfloat16 needs Ampere or newer; V100 / T4 fall back to float16 rather than emulated bf16.
        try:
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        except Exception:
            return torch.float16

    def set_device(self, index: int = 0) -> None:
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def capture_graph(self, fn: Callable[[], T], pool: Any = None) -> tuple[torch.cuda.CUDAGraph, T, Any]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy cuBLAS / SDPA setup must not happen while capturing
            fn()
        torch.cuda.current_stream().wait_stream(side)
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out, pool

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)
