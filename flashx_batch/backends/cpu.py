"""CPU backend: always available; float32 by default; sets the intra-op thread count (`setup_threads`)."""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F

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
    host_kernels = True
    int4_kernel = "int4pack_mm_cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def int8_kernel(cls, dtype: torch.dtype) -> str:
        # float32: dynamic int8 activations through oneDNN / `_int_mm`; half: torch's weight-only kernel
        if dtype == torch.float32:
            return "int8_dynamic"
        return "int8pack_mm" if dtype in (torch.bfloat16, torch.float16) else "dequant"

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def setup_threads(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)

    def device_name(self, index: int = 0) -> str:
        return platform.processor() or platform.machine()

    def prepare_model(self, model: torch.nn.Module) -> int:
        """Pack the weights of every module that opts in (a class attribute `cpu_packable = True`, a
        `pack()` method, a `pack_dtype` naming the dtype of what it would pack — None off the CPU —
        that `onednn_packs`: `models.layers.Linear`; not stacked experts, see `models.moe`) into oneDNN's
        layout, through which they then multiply. Quantized linears do not opt in and keep their own
        kernels; torch builds without oneDNN keep plain sgemm. Duck-typed, so this package never
        imports the models above it."""
        packable = [m for m in model.modules() if _cpu_packable(m)]
        for module in packable:
            module.pack()
        return len(packable)


def _cpu_packable(module: torch.nn.Module) -> bool:
    if getattr(type(module), "cpu_packable", False) is not True or not callable(getattr(module, "pack", None)):
        return False
    dtype = getattr(module, "pack_dtype", None)
    return isinstance(dtype, torch.dtype) and onednn_packs(dtype)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] in oneDNN's blocked layout for `onednn_linear` (any row count); where
    `onednn_packs(weight.dtype)`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ b) through oneDNN's linear, W packed by `onednn_pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch build multiplies `dtype` weights through oneDNN's linear with a packed
    weight: float32 where oneDNN is built in, bfloat16 where the CPU also has bfloat16 dot products
    (elsewhere torch's plain bfloat16 matmul is the better one). Checked once on a small matmul
    against F.linear, so a build whose op misbehaves keeps plain sgemm instead of computing wrong."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        weight, bias = torch.randn(24, 40).to(dtype), torch.randn(24).to(dtype)
        x = torch.randn(3, 5, 40).to(dtype)
        out = onednn_linear(x, onednn_pack(weight), bias)
    except (RuntimeError, NotImplementedError):
        return False
    return out.shape == (3, 5, 24) and torch.allclose(out.float(), F.linear(x, weight, bias).float(),
                                                       rtol=2e-2, atol=2e-2)
