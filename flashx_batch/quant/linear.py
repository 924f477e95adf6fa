"""Load-time modules that replace `models.layers.Linear` with a weight-only format (gpt-fast's top layer).

`QuantLinear` holds one format over a whole weight or a row range of it; `SplitLinear` concatenates
several row ranges (a fused `qkv` whose q rows are int4 and k / v rows int8). The decoder only ever
calls `module(x)`, so it never learns which format runs.

Kernels (`choose_kernel`, per format, device and compute dtype), chosen from measurements on CPU
(torch 2.13, one thread, when the kernels were chosen in commit 0ee4b5c; end-to-end decode
speeds: docs/benchmarks.md, "Mixed-precision weights"):
  native / cast      float weights; `cast` converts a bf16 / fp16 weight to the compute dtype per call.
  int8pack_mm        `_weight_int8pack_mm` for bf16 / fp16 activations (CPU, CUDA), at most `SMALL_M`
                     rows per call (decode): 1.8x faster than bf16 F.linear at one row. Above that the
                     same int8 tensors run `x @ q^T * scales` through float BLAS (10x faster at 256 rows).
                     For fp32 activations the CPU kernel has no vector path (4x slower than fp32
                     F.linear at one row), so fp32 always takes the BLAS route (`dequant`).
  int8_dynamic       float32 activations on CPU: int8 weights, and activations quantized to 8 bits per
                     row (per token: a row is rounded the same in any batch; `formats.quantize_rows`) at
                     each call, products summed in int32 by oneDNN's VNNI / AMX GEMM: the weight
                     prepacked at load (`formats.PackedInt8`, where torch has oneDNN's int8 linear);
                     a weight of fewer than INT_MM_MAX_WEIGHTS values also kept plain for calls of at
                     most INT_MM_MAX_ROWS rows (a decode step), which go through `torch._int_mm`: it
                     reorders the weight on every call but costs fewer microseconds a call than the
                     prepacked kernel at a few rows, while at a prefill's many rows the prepacked one
                     is up to 3x faster. Both end in the same float products in the same order, so a
                     row's output is bit-identical whichever serves it (`formats.int8_dynamic_matmul`);
                     where they are not (no VNNI: the prepacked grid is 63 steps; a oneDNN that scales
                     AMX products in another order: `formats.int_mm_matches_packed`, probed once), one
                     kernel serves every call. The kernels against float32 F.linear, per shape:
                     `jobs/experiments/int8_kernel_shapes.py` (docs/benchmarks.md, "int8 kernel per layer
                     shape"). The activation rounding is a second error beyond the
                     weight's: measurements for such an engine run this kernel itself instead of
                     `simulated`, so the planner measures what will run.
  int4pack_mm_cpu    `_weight_int4pack_mm_for_cpu` for bf16 / fp16 activations: 2-4x faster than bf16
                     F.linear at one row, ~10x slower at 256 rows (prefill). Its packed layout is
                     blocked by the CPU's vector width (opaque, machine specific), so no float copy is
                     kept for a BLAS route: an int4 prefill on CPU is slow, reported, not hidden.
  int4pack_mm_cuda   `_weight_int4pack_mm` (bf16 activations only).
  dequant            fallback anywhere else: dequantize in the compute dtype per call, then F.linear.
                     Memory saving kept, speed not.
  simulated          measurement only (`quant.sensitivity`): the dequantized weight, precomputed,
                     through F.linear. Bit-identical weight values to the real formats; the real kernels
                     differ from it only by accumulation order (tests bound it; the map records a check).
A kernel is probed once per (kernel, device, dtype) against the dequantized reference before it is
trusted; a failing or missing kernel falls back to `dequant` with a warning.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends import device_traits
from flashx_batch.quant import formats as fm

log = logging.getLogger(__name__)

KERNELS = ("native", "cast", "int8pack_mm", "int8_dynamic", "int4pack_mm_cpu", "int4pack_mm_cuda", "dequant",
           "simulated")
SMALL_M = 16  # int8pack_mm runs calls of at most this many rows; larger ones take float BLAS
# int8_dynamic: calls of at most INT_MM_MAX_ROWS rows on weights of fewer than INT_MM_MAX_WEIGHTS values go
# through `torch._int_mm`, all others prepacked (module docstring); the outputs are the same bits either way
INT_MM_MAX_ROWS = 32
INT_MM_MAX_WEIGHTS = 1 << 20
_HALF = (torch.bfloat16, torch.float16)
_probed: dict[tuple[str, str, torch.dtype], bool] = {}


def _preferred_kernel(fmt: str, device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                      group_size: int | None) -> str:
    if fmt in fm.FLOAT_FORMATS:
        return "native" if fm.FLOAT_FORMATS[fmt] == dtype else "cast"
    traits = device_traits(device)
    if fmt == "int8":
        return traits.int8_kernel(dtype)
    kernel = traits.int4_kernel
    if (kernel and group_size and dtype in _HALF
            and fm.int4_kernel_supported(kernel, out_features, in_features, group_size, dtype)):
        return kernel
    return "dequant"


def choose_kernel(fmt: str, device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                  group_size: int | None) -> str:
    """The kernel a weight of this format and shape runs on `device` with activations in `dtype`."""
    kernel = _preferred_kernel(fmt, device, dtype, out_features, in_features, group_size)
    if kernel in ("native", "cast", "dequant", "simulated"):
        return kernel
    key = (kernel, device.type, dtype)
    if key not in _probed:
        _probed[key] = _probe(fmt, kernel, device, dtype)
    return kernel if _probed[key] else "dequant"


def _probe(fmt: str, kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Run `kernel` once on a small random weight and compare with the dequantized float matmul."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=generator)
    x = torch.randn(3, 256, generator=generator).to(device=device, dtype=dtype)
    try:
        module = QuantLinear.from_float(weight.to(device), fmt, dtype, group_size=64, kernel=kernel)
        reference = x.float() @ module.reference_weight().float().T
        err = ((module(x).float() - reference).norm() / reference.norm()).item()
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("%s kernel %s unavailable on %s (%s): falling back to dequantize-per-call; %s",
                    fmt, kernel, device.type, dtype, str(exc).splitlines()[0])
        return False
    if err > 2e-2:
        log.warning("%s kernel %s on %s (%s) disagrees with the dequantized reference (rel err %.3g): "
                    "falling back to dequantize-per-call", fmt, kernel, device.type, dtype, err)
        return False
    return True


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W [N, K] held in one weight format; built by `from_float`."""

    def __init__(self, fmt: str, kernel: str, out_features: int, in_features: int, group_size: int | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.fmt, self.kernel, self.group_size, self.dtype = fmt, kernel, group_size, dtype
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("bias", None)
        self._int4: fm.Int4Operands | None = None
        self._packed: fm.PackedInt8 | None = None  # int8_dynamic's oneDNN-prepacked weight, where torch has it
        self.register_buffer("qweight_t", None)  # int8_dynamic: the plain weight [K, N] for `_int_mm`, where kept
        self.rotated = False  # weight held, and input rounded, in `formats.rotate_blocks`' basis

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: str, dtype: torch.dtype, group_size: int | None = None,
                   bias: torch.Tensor | None = None, kernel: str | None = None,
                   rotate_input: bool = False) -> QuantLinear:
        """Quantize `weight` [N, K] (any float dtype, on its device) into `fmt`; activations run in `dtype`.

        Called by `apply_precision_map` at load and by the sensitivity scan; `kernel=None` chooses one.
        `rotate_input`: the layer's inputs are heavy-tailed (one channel in a row far above the rest,
        as a gated MLP's product is); where activations are rounded to int8 (`int8_dynamic`) the
        weight is stored rotated (`formats.rotate_blocks`) and each input rotated the same way before
        its rounding. Other kernels, and inputs of a width the block does not divide, ignore it."""
        out_features, in_features = weight.shape
        if fmt == "int4":
            group_size = fm.int4_group_size(in_features, group_size or 64)
            if group_size is None:
                raise ValueError(f"int4 needs in_features divisible by 32, got {in_features}")
        else:
            group_size = None
        real = choose_kernel(fmt, weight.device, dtype, out_features, in_features, group_size) \
            if kernel in (None, "simulated") else kernel
        if kernel == "simulated" and real == "int8_dynamic":
            # measured as it will run: the per-call activation rounding turns any float imitation's
            # last-bit differences into whole rounding steps, layer after layer; the kernel is fast anyway
            kernel = real
        module = cls(fmt, kernel or real, out_features, in_features, group_size, dtype)
        module.rotated = (rotate_input and module.kernel == "int8_dynamic"
                          and in_features % fm.ROTATION_BLOCK == 0)
        with torch.no_grad():
            module._store(fm.rotate_blocks(weight.detach().float()) if module.rotated else weight.detach(), dtype)
        if bias is not None:
            module.bias = bias.detach().to(dtype).clone()
        return module

    @classmethod
    def from_int8(cls, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                  activations: bool = True) -> QuantLinear:
        """A module over int8 values `q` [N, K] and per-row `scales` [N] as they are (a pre-quantized checkpoint's:
        no float copy, no second rounding). `activations`: the weights were calibrated with int8 activations
        per token (W8A8), which the kernel chosen here applies where it has one (`int8_dynamic`); otherwise
        (weight-only int8, W8A16) a kernel that keeps activations in `dtype`. The scales are held in `dtype`,
        as the kernels take them: in bfloat16 each row's scale is rounded to 8 bits of mantissa."""
        out_features, in_features = q.shape
        kernel = choose_kernel("int8", q.device, dtype, out_features, in_features, None)
        if kernel == "int8_dynamic" and not activations:
            kernel = "dequant"  # int8 values, activations in `dtype`: `forward`'s scale-the-output route
        module = cls("int8", kernel, out_features, in_features, None, dtype)
        with torch.no_grad():
            module._store_int8(q.contiguous(), scales.float(), dtype)
        if bias is not None:
            module.bias = bias.detach().to(dtype).clone()
        return module

    def _store(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        if self.kernel == "simulated":
            self.register_buffer("weight", _simulate(weight, self.fmt, self.group_size, dtype))
        elif self.fmt in fm.FLOAT_FORMATS:
            self.register_buffer("weight", weight.to(fm.FLOAT_FORMATS[self.fmt]).contiguous().clone())
        elif self.fmt == "int8":
            self._store_int8(*fm.quantize_int8(weight), dtype)
        else:
            q, scales, zeros = fm.quantize_int4(weight, self.group_size)
            packed = fm.pack_int4(q)
            if self.kernel == "dequant":
                self.register_buffer("packed", packed)
                self.register_buffer("scales", scales.to(dtype))
                self.register_buffer("zeros", zeros.to(dtype))
            else:
                self._int4 = fm.int4_kernel_operands(self.kernel, packed, scales, zeros, self.group_size, dtype)
                self.register_buffer("kweight", self._int4.weight)
                self.register_buffer("scale_and_zero", self._int4.scale_and_zero)

    def _store_int8(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """Hold int8 values `q` [N, K] with per-row `scales` [N] in the layout this module's kernel reads."""
        if self.kernel == "int8_dynamic" and fm.onednn_int8_available():
            self._packed = fm.PackedInt8(q, scales)
        small = self.out_features * self.in_features < INT_MM_MAX_WEIGHTS
        if self.kernel == "int8_dynamic" and (self._packed is None or (small and fm.int_mm_matches_packed())):
            self.register_buffer("qweight_t", q.t().contiguous())  # `_int_mm` reads the weight as [K, N]
        elif self.kernel != "int8_dynamic":
            self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(dtype))

    def _apply(self, fn, recurse=True):  # keep the int4 operand view in step with moved buffers
        out = super()._apply(fn, recurse)
        if self._int4 is not None:
            self._int4 = fm.Int4Operands(self.kweight, self.scale_and_zero, self.group_size)
        return out

    def reference_weight(self) -> torch.Tensor:
        """The float weight [N, K] this module computes with (what its kernel should reproduce)."""
        if self.fmt in fm.FLOAT_FORMATS or self.kernel == "simulated":
            return self.weight
        if self.fmt == "int8":
            if self.kernel == "int8_dynamic":
                q = self.qweight_t.t() if self.qweight_t is not None else self._packed.int8_weight()
            else:
                q = self.qweight
            weight = fm.dequantize_int8(q, self.scales, torch.float32)
            return fm.rotate_blocks(weight) if self.rotated else weight  # the rotation is its own inverse
        if self.kernel == "dequant":
            return fm.dequantize_int4(self.packed, self.scales, self.zeros, torch.float32)
        # the kernel's own layout is opaque: read the weight back through the kernel itself
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.kweight.device)
        return fm.int4_matmul(eye.to(self.dtype), self.kernel, self._int4, self.out_features).float().T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel  # a rotated layer is int8_dynamic (`from_float`), which rotates its input as it rounds
        if kernel in ("native", "simulated"):
            out = F.linear(x, self.weight)
        elif kernel == "cast":
            out = F.linear(x, self.weight.to(x.dtype))
        elif kernel == "int8_dynamic":
            if self._packed is not None and (self.qweight_t is None or x.numel() > INT_MM_MAX_ROWS * self.in_features):
                out = self._packed.matmul(x, rotate=self.rotated)
            else:
                out = fm.int8_dynamic_matmul(x, self.qweight_t, self.scales, rotate=self.rotated)
        elif self.fmt == "int8":
            if kernel == "int8pack_mm" and x.numel() <= SMALL_M * self.in_features:
                out = fm.int8_matmul(x, self.qweight, self.scales)
            else:  # per-row scales factor out of the dot product: scale the output, not the weight
                out = F.linear(x, self.qweight.to(x.dtype)) * self.scales
        elif kernel == "dequant":
            out = F.linear(x, fm.dequantize_int4(self.packed, self.scales, self.zeros, x.dtype))
        else:
            out = fm.int4_matmul(x, kernel, self._int4, self.out_features)
        return out if self.bias is None else out + self.bias

    def nbytes(self) -> int:
        """Resident bytes of this module's weight (bias excluded: it is never quantized)."""
        packed = self.out_features * self.in_features if self._packed is not None else 0  # a byte a weight
        return packed + sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name != "bias")

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        rotated = ", input rotated" if self.rotated else ""
        return f"{self.in_features} -> {self.out_features}, {self.fmt}{group}, kernel={self.kernel}{rotated}"


def _simulate(weight: torch.Tensor, fmt: str, group_size: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight as `fmt` represents it, back in `dtype` (fake quantization for measurements)."""
    if fmt == "int8":
        return fm.dequantize_int8(*fm.quantize_int8(weight), dtype)
    if fmt == "int4":
        return fm.dequantize_int4_values(*fm.quantize_int4(weight, group_size), dtype)
    return weight.to(fm.FLOAT_FORMATS[fmt]).to(dtype).contiguous()


class SplitLinear(nn.Module):
    """A fused projection whose row ranges use different formats: outputs are concatenated in row order."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    def reference_weight(self) -> torch.Tensor:
        return torch.cat([p.reference_weight().float() for p in self.parts], dim=0)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def build_linear(weight: torch.Tensor, bias: torch.Tensor | None, pieces: list[tuple[int, int, str]],
                 dtype: torch.dtype, group_size: int, kernel: str | None = None,
                 rotate_input: bool = False) -> nn.Module:
    """A module for `weight` [N, K] whose rows [start, stop) use the format of each piece.

    Adjacent pieces with the same format are quantized as one (int8 and int4 are per row, so the
    result is identical) and so run as one kernel; a single remaining piece needs no `SplitLinear`.
    `kernel` forces one kernel for every piece (`simulated` for measurements); None chooses per piece.
    `rotate_input` as in `QuantLinear.from_float`.
    """
    merged: list[list] = []
    for start, stop, fmt in sorted(pieces):
        if merged and merged[-1][2] == fmt and merged[-1][1] == start:
            merged[-1][1] = stop
        else:
            merged.append([start, stop, fmt])
    if merged[0][0] != 0 or merged[-1][1] != weight.shape[0] or any(
            a[1] != b[0] for a, b in zip(merged, merged[1:])):
        raise ValueError(f"pieces {pieces} do not tile the {weight.shape[0]} rows of the weight exactly")
    bias = None if bias is None else bias.detach().to(dtype).clone()
    if len(merged) == 1:
        return QuantLinear.from_float(weight, merged[0][2], dtype, group_size, bias=bias, kernel=kernel,
                                      rotate_input=rotate_input)
    parts = [QuantLinear.from_float(weight[start:stop], fmt, dtype, group_size, kernel=kernel,
                                    rotate_input=rotate_input) for start, stop, fmt in merged]
    return SplitLinear(parts, bias)
