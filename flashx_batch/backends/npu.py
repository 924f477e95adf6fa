"""Ascend NPU backend: the only module that imports `torch_npu`, and only when asked to.

`torch_npu` registers itself as torch's `npu` device on import (and, when installed, through
torch's device-backend autoload on every `import torch`). Without the CANN toolkit that import
fails with `libhccl.so: cannot open shared object file`; `is_available()` swallows it and
`python -m flashx_batch.doctor` explains it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from flashx_batch.backends.base import Backend

# SoCs with native bfloat16 (Atlas A2 / A3 training and inference series). 910A, 910 Pro and the
# 310P cards compute in float16 only.
_BF16_SOCS = ("910b", "910_93", "910c")


def _torch_npu() -> ModuleType:
    return importlib.import_module("torch_npu")


def _npu() -> Any:
    """`torch.npu`, present once `torch_npu` is imported."""
    _torch_npu()
    return torch.npu  # type: ignore[attr-defined]


def soc_has_bf16(device_name: str) -> bool:
    name = device_name.lower().replace("ascend", "")
    return any(soc in name for soc in _BF16_SOCS)


class NpuBackend(Backend):
    name = "npu"
    device_type = "npu"
    ray_resource = "NPU"
    ray_accelerator_key = "NPU"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    # With this set Ray leaves ASCEND_RT_VISIBLE_DEVICES alone (HCCL jobs that must see every card);
    # the actor then selects its own card from Ray's accelerator ids (`assigned_device_index`).
    ray_noset_env = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
    supports_graphs = False  # torchair / aclgraph are not wired in yet
    collective = "hccl"

    @classmethod
    def is_available(cls) -> bool:
        try:
            return bool(_npu().is_available())
        except Exception:  # not installed, or installed without CANN: `doctor` explains which
            return False

    @property
    def default_dtype(self) -> torch.dtype:  # type: ignore[override]
        return torch.bfloat16 if self._bf16() else torch.float16

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        if self._bf16():
            return (torch.float32, torch.bfloat16, torch.float16)
        return (torch.float32, torch.float16)

    def _bf16(self) -> bool:
        try:
            return soc_has_bf16(self.device_name())
        except Exception:
            return False

    def device(self, index: int = 0) -> torch.device:
        _torch_npu()  # it renames torch's PrivateUse1 device to "npu"; before that "npu:0" does not parse
        return torch.device(self.device_string(index))

    def set_device(self, index: int = 0) -> None:
        _npu().set_device(index)

    def synchronize(self) -> None:
        _npu().synchronize()

    def memory_info(self) -> tuple[int, int]:
        return _npu().mem_get_info()

    def empty_cache(self) -> None:
        _npu().empty_cache()

    def device_count(self) -> int:
        return _npu().device_count()

    def device_name(self, index: int = 0) -> str:
        return _npu().get_device_name(index)

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        try:
            facts["torch_npu"] = getattr(_torch_npu(), "__version__", "?")
        except Exception as exc:
            facts["error"] = f"{type(exc).__name__}: {exc}"
        return facts
