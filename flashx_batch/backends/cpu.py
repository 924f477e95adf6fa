"""CPU backend: always available; float32 by default; sets the intra-op thread count (`setup_threads`)."""

from __future__ import annotations

import platform

import torch

from flashx_batch.backends.base import Backend


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    default_dtype = torch.float32
    # a cut must save more cache reading than a second attention call and the cat cost; at the rate
    # decode attention reads the cache on CPU, 256 KiB pays for them several times over (the
    # measurements: docs/architecture.md, "How the runtime works")
    attention_split_min_bytes = 256 << 10
    prefers_row_extents = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def setup_threads(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)

    def device_name(self, index: int = 0) -> str:
        return platform.processor() or platform.machine()

    def prepare_model(self, model: torch.nn.Module, decode_rows: list[int]) -> int:
        """MKL-pack the weights of every module that opts in (a class attribute `mkl_packable = True`,
        a `prepack(decode_rows)` method, a float32 `weight`: `models.layers.Linear`) for MKL's
        few-rows sgemm. Quantized linears do not opt in and keep their own kernels; builds without
        MKL keep plain sgemm. Duck-typed, so this package never imports the models above it."""
        if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
            return 0
        packable = [m for m in model.modules() if _mkl_packable(m)]
        for module in packable:
            module.prepack(decode_rows)
        return len(packable)


def _mkl_packable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (getattr(type(module), "mkl_packable", False) is True and callable(getattr(module, "prepack", None))
            and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32)
