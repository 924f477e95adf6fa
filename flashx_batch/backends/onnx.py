"""ONNX Runtime backend: for ROCm / DCU hosts whose torch is not a HIP build.

The model runs in `onnxruntime` (`runtime.onnx_runner.OnnxRunner`), not in the torch runtime, so
`torch_runtime` is False; torch stays on the host for loading weights and sampling. Who calls it:
`OnnxRunner` (providers, host device), the Ray runner (`ray_options`), `doctor`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from flashx_batch.backends.base import Backend

# Best first. ROCm EP is the older AMD path (removed in recent onnxruntime releases in favour of
# MIGraphX); CUDA EP is listed so the same path runs on NVIDIA hosts for comparison.
GPU_PROVIDERS = ("MIGraphXExecutionProvider", "ROCMExecutionProvider", "CUDAExecutionProvider")
CPU_PROVIDER = "CPUExecutionProvider"


def choose_providers(available: list[str] | tuple[str, ...]) -> list[str]:
    """The providers an `InferenceSession` should get, best first, always ending with the CPU one."""
    chosen = [p for p in GPU_PROVIDERS if p in available]
    return [*chosen, CPU_PROVIDER]


def available_providers() -> list[str]:
    try:
        return list(importlib.import_module("onnxruntime").get_available_providers())
    except Exception:
        return []


class OnnxBackend(Backend):
    name = "onnx"
    device_type = "cpu"  # torch-side tensors (sampling, weights before export) live on the host
    default_dtype = torch.float32
    supported_dtypes = (torch.float32,)
    torch_runtime = False
    collective = None

    @classmethod
    def is_available(cls) -> bool:
        try:
            return importlib.util.find_spec("onnxruntime") is not None and bool(available_providers())
        except Exception:
            return False

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def providers(self) -> list[str]:
        return choose_providers(available_providers())

    def uses_gpu(self) -> bool:
        return self.providers()[0] != CPU_PROVIDER

    def device_name(self, index: int = 0) -> str:
        return self.providers()[0]

    def ray_options(self, extra_resources: Mapping[str, float] | None = None) -> dict[str, Any]:
        # One GPU per actor only when onnxruntime here can actually drive a GPU.
        options = {"num_gpus": 1.0} if self.uses_gpu() else {}
        if extra_resources:
            options["resources"] = dict(extra_resources)
        return options

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["providers"] = self.providers()
        return facts
