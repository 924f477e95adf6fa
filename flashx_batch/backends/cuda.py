"""NVIDIA CUDA backend (torch built for CUDA, not HIP)."""

from __future__ import annotations

import torch

from flashx_batch.backends.base import Backend


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    ray_num_gpus = 1.0
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    supports_graphs = True

    @classmethod
    def is_available(cls) -> bool:
        try:
            return torch.version.hip is None and torch.cuda.is_available()
        except Exception:  # a broken driver must not take `auto` down
            return False

    def set_device(self, index: int = 0) -> None:
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
