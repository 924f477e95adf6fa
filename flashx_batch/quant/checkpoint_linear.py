"""The modules a pre-quantized checkpoint's linears run as, built from the loader's row layouts
(`models.quantized_rows`): `quantized_linear` is the factory `models.loader.load_model` takes.

- int8 (compressed-tensors W8A8 / W8A16) onto `QuantLinear`'s int8 kernels with the checkpoint's own
  values and scales (`QuantLinear.from_int8`): W8A8 on the CPU in float32 runs `int8_dynamic`, the
  kernel our own int8 path runs, and an all-int8 model gets the fused decode step as ours does.
- int4 (GPTQ, AWQ, compressed-tensors pack-quantized) and FP8 (block-wise releases, compressed-tensors
  float8) as `DequantizingLinear`: kept as stored (a byte per two int4 values, a byte per FP8 value,
  their scales) and dequantized into the activations' dtype for each matmul. Why not at load: host
  memory then stays near the checkpoint's bytes on disk (a float32 copy is 8x an int4 checkpoint, 4x an
  FP8 one), which is what decides whether a model fits a node. On the host the per-call dequantization is
  one compiled pass into a reused float32 buffer (`quant.dequant_kernels`: one float copy of the largest
  linear, held once per thread), then BLAS; its cost: docs/benchmarks.md, "Pre-quantized checkpoints".
  Its weights are exactly the formats' reference dequantization, so its outputs are those of a float
  model loaded from the dequantized weights.
  Not built: FP8 matmuls with block scales on GPUs that have them, and our int4 kernels over
  these weights (their zero-point convention differs; converting would round the weights again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends import on_host
from flashx_batch.models.quantized_rows import Fp8Rows, Int4Rows, Int8Rows, RowLayout
from flashx_batch.quant import dequant_kernels
from flashx_batch.quant.linear import QuantLinear, SplitLinear


class DequantizingLinear(nn.Module):
    """y = x W^T (+ b), W an int4 or FP8 row layout kept as stored, dequantized for each call: on the host by
    `quant.dequant_kernels` into a reused float32 buffer, elsewhere by torch ops."""

    kernel = "dequant"

    def __init__(self, layout: Int4Rows | Fp8Rows, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.fmt = "int4" if isinstance(layout, Int4Rows) else "fp8"
        self.out_features = layout.rows
        self.group_size: int | None = None  # int4: input channel k in group k // group_size (None: `group` says)
        if isinstance(layout, Int4Rows):
            self.in_features = layout.in_features
            for name in ("packed", "zeros", "group"):
                self.register_buffer(name, getattr(layout, name).to(device))
            # float32 scales (the stored float16 / bfloat16 values exactly): what the kernels multiply by
            self.register_buffer("scales", layout.scales.to(device=device, dtype=torch.float32))
            size = max(int((layout.group == 0).sum()), 1)  # group 0's channels: the group size, if contiguous
            contiguous = torch.equal(layout.group, torch.arange(self.in_features) // size)
            self.group_size = size if contiguous and size % 2 == 0 else None
        else:
            self.in_features, self.block_cols = layout.q.shape[1], layout.block_cols
            self.register_buffer("q", layout.q.to(device))
            self.register_buffer("scales", layout.scales.to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype=dtype, device=device).clone())
        self._parts = self._kernel_parts()

    def _kernel_parts(self) -> dict:
        """What `dequant_kernels.dequantize_into` reads: built once, not per call (rebuilt when buffers move)."""
        return dict(self.named_buffers(), block_cols=getattr(self, "block_cols", None))

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._parts = self._kernel_parts()
        return out

    def layout(self) -> RowLayout:
        if self.fmt == "int4":
            return Int4Rows(self.packed, self.zeros, self.scales, self.group, self.in_features)
        return Fp8Rows(self.q, self.scales, self.block_cols)

    def reference_weight(self) -> torch.Tensor:
        """The float32 weight [N, K] this module multiplies by."""
        return self.layout().to_float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if on_host(x) and dequant_kernels.kernels() is not None:
            parts = self._parts
            step = dequant_kernels.block_rows(self.out_features, self.in_features)
            out = None if step == self.out_features else x.new_empty(*x.shape[:-1], self.out_features)
            for first in range(0, self.out_features, step):
                weight = dequant_kernels.buffer(min(step, self.out_features - first), self.in_features)
                dequant_kernels.dequantize_into(weight, self.fmt, parts, self.group_size, first)
                rows = slice(first, first + weight.shape[0])
                part = F.linear(x, weight if x.dtype == torch.float32 else weight.to(x.dtype),
                                None if self.bias is None else self.bias[rows])
                if out is None:  # the whole weight in one block
                    return part
                out[..., rows] = part
            return out
        return F.linear(x, self.reference_weight().to(x.dtype), self.bias)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name != "bias")

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt} as stored, dequantized per call"


def _one(layout: RowLayout, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
    if isinstance(layout, Int8Rows):
        return QuantLinear.from_int8(layout.q.to(device), layout.scales.to(device), dtype, bias, layout.activations)
    return DequantizingLinear(layout, bias, dtype, device)


def quantized_linear(layouts: RowLayout | list[RowLayout], bias: torch.Tensor | None, dtype: torch.dtype,
                     device: torch.device) -> nn.Module:
    """The module for one linear: its layout, or a fused projection's parts that cannot share one (a
    `SplitLinear` that concatenates their outputs)."""
    if not isinstance(layouts, list):
        return _one(layouts, bias, dtype, device)
    bias = None if bias is None else bias.detach().to(dtype=dtype, device=device).clone()
    return SplitLinear([_one(layout, None, dtype, device) for layout in layouts], bias)
