"""int8 experts: a mixture-of-experts layer's stacked expert weight in our int8 format.

`Int8Experts` replaces one stacked weight of `models.moe.SparseMoE` (`gate_up` [E, 2 x inter, hidden] or `down`
[E, hidden, inter]) with int8 values per output row and a float32 scale each — every expert quantized exactly
as a dense layer's weight is (`formats.quantize_int8`). It runs the kernel a dense int8 layer would get
(`linear.choose_kernel`):

- `int8_dynamic` (float32 on the CPU): each row of activations rounded to int8 with its own scale
  (`formats.quantize_rows`), products summed in int32, then scaled. A decode step's few (row, expert) pairs over
  many experts (`WALK_MIN_EXPERTS`) go through one compiled walk over all of them
  (`backends.cpu_moe.int8_expert_rows`); more rows (a prefill), or few experts, through `torch._int_mm` per
  active expert. Integer sums are exact and both scale in the same order, so a row's
  outputs are the same bits whichever serves it, in any batch. The `down` weight's input is a gated product,
  heavy-tailed as a dense MLP's is: it is rotated as a dense `down` is (`formats.rotate_blocks`), where the block
  divides the width.
- anywhere else: weight-only int8, activations in the model's dtype, one matmul per active expert with the
  scales applied to its output (as `QuantLinear`'s `dequant` kernel).

Expert weights are most of a mixture-of-experts model's bytes, and a decode step streams every expert a batch
visits: int8 reads a quarter of float32's bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends import cpu_moe, on_host
from flashx_batch.models import moe
from flashx_batch.quant import formats as fm
from flashx_batch.quant.linear import choose_kernel

# experts from which a decode step's pairs take the compiled walk rather than `_int_mm` per active expert. One
# thread, 2026-12-06, cold weights, walk ÷ loop time: 8 experts (2-4 pairs each) 1.33-2x slower, 16 experts 1.36x
# and 32 experts 1.09x slower; 64 experts 1.17-1.29x faster (2-3 pairs each), 128 experts 1.95x faster
WALK_MIN_EXPERTS = 48


class Int8Experts(nn.Module):
    """Stacked int8 expert weights `q` [E, O, K] with per-row `scales` [E, O] (module docstring)."""

    fmt = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, kernel: str, rotated: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.kernel, self.rotated, self.dtype = kernel, rotated, dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype, rotate_input: bool = False) -> Int8Experts:
        """Quantize stacked float `weight` [E, O, K]; activations run in `dtype`. `rotate_input` as in
        `QuantLinear.from_float` (a `down` weight's gated input)."""
        experts, out_features, in_features = weight.shape
        kernel = choose_kernel("int8", weight.device, dtype, out_features, in_features, None)
        if kernel != "int8_dynamic":
            kernel = "dequant"  # weight-only: int8 values, matmuls in `dtype` with the scales on the output
        rotated = rotate_input and kernel == "int8_dynamic" and in_features % fm.ROTATION_BLOCK == 0
        q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scales = torch.empty(experts, out_features, dtype=torch.float32, device=weight.device)
        with torch.no_grad():
            for e in range(experts):  # one expert at a time: no float copy of the whole stack
                w = weight[e].float()
                q[e], scales[e] = fm.quantize_int8(fm.rotate_blocks(w) if rotated else w)
        return cls(q, scales, kernel, rotated, dtype)

    def reference_weight(self) -> torch.Tensor:
        """The float weight [E, O, K] this module computes with, in the layer's own basis."""
        weight = self.q.float() * self.scales[:, :, None]
        return fm.rotate_blocks(weight) if self.rotated else weight  # the rotation is its own inverse

    def sorted_rows(self, rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [P, K] sorted by `experts` [P] (`counts` [E] rows each) -> [P, O] in the rows' dtype."""
        if self.kernel != "int8_dynamic":
            return self._weight_only(rows, counts)
        codes, peak = fm.quantize_rows(rows, rotate=self.rotated)
        # every form scales as `formats.int8_dynamic_matmul` scales `_int_mm`'s sums (`scale_int8_sums`): same bits
        if len(rows) <= moe.DECODE_MAX_PAIRS and len(counts) >= WALK_MIN_EXPERTS and on_host(rows):
            sums = cpu_moe.int8_expert_rows(codes, experts, self.q)
            if sums is not None:
                return fm.scale_int8_sums(sums, self.scales[experts], peak)
        # a prefill, few experts, or no compiled walk: a GEMM per active expert, scaled while in cache
        out, start = torch.empty(len(rows), self.q.shape[1], dtype=torch.float32, device=rows.device), 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                end = start + count
                out[start:end] = fm.scale_int8_sums(torch._int_mm(codes[start:end], self.q[expert].t()),
                                                    self.scales[expert], peak[start:end])
                start = end
        return out

    def _weight_only(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out, start = rows.new_empty(len(rows), self.q.shape[1]), 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                part = rows[start : start + count]
                out[start : start + count] = F.linear(part, self.q[expert].to(rows.dtype)) \
                    * self.scales[expert].to(rows.dtype)
                start += count
        return out

    def extra_repr(self) -> str:
        experts, out_features, in_features = self.q.shape
        rotated = ", input rotated" if self.rotated else ""
        return f"{experts} experts, {in_features} -> {out_features}, int8, kernel={self.kernel}{rotated}"
