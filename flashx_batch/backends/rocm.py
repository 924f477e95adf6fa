"""AMD ROCm / Hygon DCU backend: torch built for HIP exposes devices through the `cuda` API."""

from __future__ import annotations

import torch

from flashx_batch.backends.cuda import CudaBackend


class RocmBackend(CudaBackend):
    name = "rocm"
    # Ray rejects ROCR_VISIBLE_DEVICES; HIP_VISIBLE_DEVICES is the variable it sets and honours.
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    supports_graphs = False

    @classmethod
    def is_available(cls) -> bool:
        try:
            return torch.version.hip is not None and torch.cuda.is_available()
        except Exception:
            return False
