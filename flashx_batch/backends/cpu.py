"""CPU backend: always available; float32 by default, thread count set by the engine."""

from __future__ import annotations

import platform

import torch

from flashx_batch.backends.base import Backend


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    default_dtype = torch.float32

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_name(self, index: int = 0) -> str:
        return platform.processor() or platform.machine()
