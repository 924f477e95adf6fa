"""CPU backend: always available; float32 by default, thread count set by the engine."""

from __future__ import annotations

import platform

import torch

from flashx_batch.backends.base import Backend


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    default_dtype = torch.float32
    # a second attention call plus the cat: ~8 us more (measured); reading 256 KiB of cache ~40 us at the
    # ~6.6 GB/s decode attention reaches, so a cut this size pays for itself several times over
    attention_split_min_bytes = 256 << 10
    prefers_row_extents = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_name(self, index: int = 0) -> str:
        return platform.processor() or platform.machine()

    def prepare_model(self, model: torch.nn.Module, decode_rows: list[int]) -> int:
        """Pack every float32 `Linear` for MKL's few-rows sgemm (see `Linear.prepack`). Quantized
        linears keep their own kernels; builds without MKL keep plain sgemm."""
        from flashx_batch.models.layers import Linear

        if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
            return 0
        linears = [m for m in model.modules() if type(m) is Linear and m.weight.dtype == torch.float32]
        for module in linears:
            module.prepack(decode_rows)
        return len(linears)
