"""Ascend NPU backend: the only module that imports `torch_npu`, and only when asked to."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from flashx_batch.backends.base import Backend


def _torch_npu():
    return importlib.import_module("torch_npu")


class NpuBackend(Backend):
    name = "npu"
    device_type = "npu"
    ray_resource = "NPU"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            _torch_npu()
            return bool(torch.npu.is_available())  # type: ignore[attr-defined]
        except Exception:  # torch_npu without CANN raises on import: `doctor` explains it
            return False

    def set_device(self, index: int = 0) -> None:
        _torch_npu()
        torch.npu.set_device(index)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        torch.npu.synchronize()  # type: ignore[attr-defined]

    def memory_info(self) -> tuple[int, int]:
        return torch.npu.mem_get_info()  # type: ignore[attr-defined]

    def empty_cache(self) -> None:
        torch.npu.empty_cache()  # type: ignore[attr-defined]
