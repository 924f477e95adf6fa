"""Weight formats as pure tensor functions: quantize, pack, unpack, dequantize, matmul.

No modules and no model knowledge here (gpt-fast's bottom layer): `quant.linear` builds modules
from these, `quant.sensitivity` and the tests call them directly.

Formats (one name each, used in precision maps):
  fp32 / bf16 / fp16  the weight stored in that float dtype.
  int8  symmetric per output channel: w ~= q * scale, q in [-127, 127], one scale per row.
  int4  asymmetric per group of `group_size` input channels along each row:
        w ~= (q - 8) * scale + zero, q in [0, 15]. The "zero" is a float offset (the weight value
        that q = 8 stands for), which is the convention PyTorch's int4 kernels dequantize with.

Our storage layout, independent of any kernel: int4 values packed two per byte along K,
element 2j in the low nibble and 2j+1 in the high nibble: `[N, K/2] uint8`. Scales and zeros are
`[N, K/G]` float32. Kernel layouts are derived from it at load time by `int4_kernel_operands`.

PyTorch kernel rules, found by experiment on torch 2.13 (CPU) and from the CUDA kernel's checks:
  `_weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N])`: x 2-D, contiguous last dim; scales
      in x's dtype; fp32 / bf16 / fp16 on CPU.
  `_convert_weight_to_int4pack_for_cpu(q int32 [N, K] values 0..15, inner_k_tiles)` -> uint8
      [N, K/2] in a blocked, opaque order; needs N % 16 == 0; inner_k_tiles is ignored.
  `_weight_int4pack_mm_for_cpu(x [M, K], packed, G, scale_and_zero [K/G, N, 2])`: x in fp32 / bf16 /
      fp16, scale_and_zero in x's dtype, K % G == 0.
  CUDA `_convert_weight_to_int4pack(uint8 [N, K/2] (even << 4 | odd), inner_k_tiles)` and
      `_weight_int4pack_mm(x bf16 [M, K], packed, G, scale_and_zero bf16 [K/G, N, 2])`: N % 8 == 0,
      K % (inner_k_tiles * 16) == 0, G in {32, 64, 128, 256}. Not verified on a GPU in this repo yet;
      `quant.linear` probes every kernel against the dequantized reference before using it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from flashx_batch.backends import on_host
from flashx_batch.quant import row_kernel

FLOAT_FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT_FORMATS = ("int8", "int4")
FORMATS = (*INT_FORMATS, *FLOAT_FORMATS)
INT4_GROUP_SIZES = (256, 128, 64, 32)
# Higher precision first: the planner upgrades a unit by moving one step left.
PRECISION_ORDER = ("fp32", "bf16", "fp16", "int8", "int4")


def format_of_dtype(dtype: torch.dtype) -> str:
    """The float format name of a torch dtype (the "unquantized" format of a model)."""
    for name, value in FLOAT_FORMATS.items():
        if value == dtype:
            return name
    raise ValueError(f"no weight format for dtype {dtype}; use one of {list(FLOAT_FORMATS.values())}")


def int4_group_size(in_features: int, preferred: int) -> int | None:
    """The group size int4 uses for a row of `in_features`: `preferred` if it divides the row, else the
    largest standard size below it that does; None when none does (int4 is then unavailable)."""
    for size in (preferred, *(g for g in INT4_GROUP_SIZES if g < preferred)):
        if size in INT4_GROUP_SIZES and in_features % size == 0:
            return size
    return None


def format_bits(fmt: str) -> int:
    return {"int4": 4, "int8": 8}.get(fmt) or torch.finfo(FLOAT_FORMATS[fmt]).bits


def weight_bytes(fmt: str, out_features: int, in_features: int, group_size: int | None,
                 scale_dtype: torch.dtype) -> int:
    """Bytes a weight occupies in memory in `fmt`, scales and zeros included (kept in `scale_dtype`,
    the compute dtype, because that is what the kernels read)."""
    itemsize = torch.empty((), dtype=scale_dtype).element_size()
    if fmt == "int8":
        return out_features * in_features + out_features * itemsize
    if fmt == "int4":
        if group_size is None:
            raise ValueError("int4 needs a group size")
        groups = in_features // group_size
        return out_features * in_features // 2 + 2 * out_features * groups * itemsize
    return out_features * in_features * (format_bits(fmt) // 8)


# ---- int8, per output channel ----------------------------------------------------------------
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q int8 [N, K], scales float32 [N]); symmetric, round to nearest."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # an all-zero row keeps a finite scale
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [N, K], scales [N]) -> weight [N, K] in `dtype`."""
    return (q.float() * scales.float()[:, None]).to(dtype)


# ---- int4, group-wise with float zeros ---------------------------------------------------------
def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q uint8 [N, K] values 0..15, scales [N, K/G], zeros [N, K/G]) float32.

    Each group's [min, max] maps onto 0..15; `zero` is the value q = 8 decodes to."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}")
    w = weight.float().reshape(out_features, in_features // group_size, group_size)  # [N, K/G, G]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    zeros = lo + 8.0 * scales
    return q.reshape(out_features, in_features), scales, zeros


def dequantize_int4_values(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, K] values 0..15, scales / zeros [N, K/G]) -> weight [N, K], computed in `dtype`."""
    out_features, in_features = q.shape
    w = q.reshape(out_features, scales.shape[1], -1).to(dtype)  # [N, K/G, G], one allocation
    w.sub_(8.0).mul_(scales.to(dtype)[..., None]).add_(zeros.to(dtype)[..., None])
    return w.reshape(out_features, in_features)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> uint8 [N, K/2]: element 2j in the low nibble, 2j+1 in the high one."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even row length, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> q uint8 [N, K] values 0..15 (inverse of `pack_int4`)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int4_values(unpack_int4(packed), scales, zeros, dtype)


# ---- kernels ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Operands:
    """What an int4 kernel reads: its own packed weight layout and the [K/G, N, 2] scale/zero table."""

    weight: torch.Tensor
    scale_and_zero: torch.Tensor
    group_size: int


def int4_kernel_supported(kernel: str, out_features: int, in_features: int, group_size: int,
                          dtype: torch.dtype) -> bool:
    """Shape and dtype rules of the two int4 kernels (see the module docstring)."""
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        return False
    if kernel == "int4pack_mm_cpu":
        return out_features % 16 == 0 and dtype in FLOAT_FORMATS.values()
    if kernel == "int4pack_mm_cuda":
        return dtype == torch.bfloat16 and out_features % 8 == 0 and cuda_inner_k_tiles(in_features) is not None
    return False


def cuda_inner_k_tiles(in_features: int) -> int | None:
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    return None


def int4_kernel_operands(kernel: str, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int, dtype: torch.dtype) -> Int4Operands:
    """Convert our storage layout into `kernel`'s layout on `packed`'s device."""
    scale_and_zero = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/G, N, 2]
    if kernel == "int4pack_mm_cpu":
        values = unpack_int4(packed).to(torch.int32)
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2)
    elif kernel == "int4pack_mm_cuda":
        values = unpack_int4(packed)
        cuda_packed = ((values[:, 0::2] << 4) | values[:, 1::2]).to(torch.uint8).contiguous()
        weight = torch.ops.aten._convert_weight_to_int4pack(cuda_packed, cuda_inner_k_tiles(values.shape[1]))
    else:
        raise ValueError(f"unknown int4 kernel {kernel!r}")
    return Int4Operands(weight, scale_and_zero, group_size)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> contiguous [M, K] (the kernels take 2-D inputs only)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (q * scales)^T -> [..., N] via `_weight_int8pack_mm`; scales already in x.dtype."""
    out = torch.ops.aten._weight_int8pack_mm(_as_rows(x), q, scales)
    return out.reshape(*x.shape[:-1], q.shape[0])


def quantize_rows(rows: torch.Tensor, steps: float = 127.0, padded: int | None = None, offset: int = 0,
                  rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations rows float32 [M, K] (any strides) -> (int8 codes [padded or M, K], peak [M, 1] float32):
    row i divided by its absolute maximum and rounded on a grid of `steps` steps each side of 0
    (x ~= code * peak / steps). One scale per row (per token), so a row is rounded the same in any
    batch; codes past row M (a caller's padding) are 0. With `offset`, every code (padding too) has
    it added modulo 256: read as uint8, the codes of a zero point `offset` (oneDNN's uint8 input).

    The codes live in this thread's workspace (`_workspace`): valid until the next call, which is
    all a matmul needs. A prefill's rows run to many MB, and a fresh tensor that size costs its page
    faults on every call (several times the arithmetic); the workspace is faulted in once. A decode
    step's few rows go through one compiled pass (`row_kernel`), where torch's eight small ops would
    cost their dispatch each. No float -> uint8 conversion (several times slower than float -> int8
    in torch's CPU kernels): the offset is added to the int8 codes' bits. A NaN row has a NaN peak
    (its output is NaN again once multiplied by it); its codes are meaningless and touch no other row.

    `rotate`: the rows are `rotate_blocks`' first (a rotated layer's input), in the compiled pass
    where it serves (the same bits)."""
    count, width = rows.shape
    padded = count if padded is None else padded
    fused = row_kernel.kernel() if (count * width <= _SMALL_ROWS and on_host(rows)
                                    and rows.dtype == torch.float32) else None
    if fused is not None:
        codes, peak, codes_out, peak_out = _row_buffers(count, width, padded)
        hadamard = _hadamard_numpy(ROTATION_BLOCK) if rotate else row_kernel.NO_ROTATION
        # a strided view (a gated MLP's product) copied first: the compiled loops vectorize over C-contiguous
        # rows only, and the copy costs less than the difference (3-4x on a rotated row)
        fused(rows.detach().contiguous().numpy(), float(steps), int(offset), hadamard, codes_out, peak_out)
        if padded > count:
            codes[count:].fill_(offset - 256 if offset > 127 else offset)
        return codes, peak
    if rotate:
        rows = rotate_blocks(rows)
    codes = _workspace("codes", padded * width, torch.int8, rows.device).view(padded, width)
    if count * width <= _SMALL_ROWS:  # two ops instead of four: at decode's few rows ops are the cost
        peak = rows.abs().amax(dim=1, keepdim=True)
    else:  # no |rows| temporary: at a prefill's many rows passes are the cost
        peak = torch.maximum(rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_())
    peak.clamp_(min=1e-12)
    scaled = _workspace("scaled", count * width, torch.float32, rows.device).view(count, width)
    torch.mul(rows, peak.reciprocal().mul_(steps), out=scaled).round_()
    if padded == count:
        codes.copy_(scaled)
    else:
        codes[:count].copy_(scaled)
        codes[count:].zero_()
    if offset:
        codes.view(torch.uint8).add_(offset)  # modulo 256
    return codes, peak


_SMALL_ROWS = 1 << 16  # elements up to which `quantize_rows` takes |rows| in one temporary


_workspaces = threading.local()


_ROW_BUFFER_SHAPES = 256  # (rows, width, padded) triples whose buffers a thread keeps; past that, a fresh set


def _row_buffers(count: int, width: int, padded: int
                 ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """This thread's codes int8 [padded, width] and peak float32 [count, 1] for the compiled rounding,
    with the numpy views it writes through (codes as uint8), kept per shape: a decode step's calls
    come in a few shapes, and building the views costs more than the rounding. Valid until the next
    call of the same shape (the `_workspace` contract)."""
    buffers = _workspaces.__dict__.setdefault("rows", {})
    key = (count, width, padded, torch.is_inference_mode_enabled())  # see `_workspace`
    entry = buffers.get(key)
    if entry is None:
        if len(buffers) >= _ROW_BUFFER_SHAPES:
            buffers.clear()
        codes = torch.empty(padded, width, dtype=torch.int8)
        peak = torch.empty(count, 1, dtype=torch.float32)
        entry = buffers[key] = (codes, peak, codes[:count].view(torch.uint8).numpy(), peak.numpy())
    return entry


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least `numel` elements, this thread's own, reused across calls (grown, never
    shrunk: it holds the largest activation of its kind this thread has rounded)."""
    buffers = _workspaces.__dict__.setdefault("buffers", {})
    # a buffer made under torch.inference_mode cannot be written outside it: one of each kind
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


INT_MM_STEPS = 127  # the activation grid `int8_dynamic_matmul` rounds on (int8 x int8 cannot saturate)
_INV_STEPS = torch.tensor(1.0 / INT_MM_STEPS, dtype=torch.float32)


def int8_dynamic_matmul(x: torch.Tensor, q_t: torch.Tensor, scales: torch.Tensor, rotate: bool = False
                        ) -> torch.Tensor:
    """x float32 [..., K] @ (q * scales)^T -> [..., N] in int8: each row of x quantized with its own
    scale (`quantize_rows`), int8 x int8 products accumulated in int32 by `torch._int_mm` (oneDNN's
    VNNI / AMX GEMM on x86), then the scales applied. `q_t` is the int8 weight transposed, [K, N];
    `scales` float32 [N].

    The float products are oneDNN's int8 linear's own, in its order — the exact int32 sum times the
    input's step (1 / 127 in float32), times the weight row's scale, times the row's peak — so a row
    comes out bit-identical to `PackedInt8.matmul` on a 127-step grid, whichever of the two a call
    takes. `rotate` as in `quantize_rows`."""
    codes, peak = quantize_rows(x.reshape(-1, x.shape[-1]), rotate=rotate)
    out = scale_int8_sums(torch._int_mm(codes, q_t), scales, peak)
    return out.reshape(*x.shape[:-1], q_t.shape[1])


def scale_int8_sums(sums: torch.Tensor, scales: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """int32 dot products of rows rounded by `quantize_rows` -> float32: (sum x the grid's step) x the weight
    row's scale x the input row's peak, in that order (every int8 path that must agree scales through here)."""
    return torch.mul(sums, _INV_STEPS).mul_(scales).mul_(peak)  # int32 x float32: float32


PAD_ROWS = 64  # `PackedInt8` rounds calls of more rows up to a multiple of this


class PackedInt8:
    """int8 weights [N, K] with per-row scales, prepacked once for oneDNN's int8 linear
    (`torch.ops.onednn.qlinear_*`, x86 torch builds).

    `torch._int_mm` hands oneDNN an unpacked weight, which it reorders on every call: at decode's few
    rows that reorder is most of the time. Here the weight is packed at load and each call quantizes
    its input per row — divided by the row's absolute maximum and rounded on a fixed grid of 127
    steps (63 where the CPU has no VNNI int8 dot products, whose 16-bit pair sums could saturate),
    handed over as uint8 with zero point steps + 1 and that fixed scale — then multiplies each output row
    back by its maximum. Every row is rounded exactly as it would be alone; like float32 BLAS, the
    kernel may still sum a row in another order for another row count (last-bit differences)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
        self.scales = scales.reshape(-1).float().contiguous()
        self.zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.steps = 127.0 if has_vnni() else 63.0
        self.zero = int(self.steps) + 1  # the uint8 code of 0.0

    def matmul(self, x: torch.Tensor, rotate: bool = False) -> torch.Tensor:
        """x float32 [..., K] -> [..., N]; `rotate` as in `quantize_rows`."""
        rows = x.reshape(-1, x.shape[-1])  # a view where it can be: quantize_rows reads any strides
        count = len(rows)
        # oneDNN builds a kernel per new row count (~1 ms): calls of many rows are padded with zero codes
        padded = count + (-count % PAD_ROWS if count > PAD_ROWS else 0)
        codes, peak = quantize_rows(rows, self.steps, padded, offset=self.zero, rotate=rotate)
        xq = codes.view(torch.uint8)  # code c as zero + c (modulo 256)
        out = torch.ops.onednn.qlinear_pointwise(xq, 1.0 / self.steps, self.zero, self.packed, self.scales,
                                                 self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        out = out if padded == count else out[:count]
        return out.mul_(peak).reshape(*x.shape[:-1], self.out_features)

    def int8_weight(self) -> torch.Tensor:
        """The int8 values [N, K] it holds, read back through the kernel itself (the packed layout is
        oneDNN's own): the identity's rows quantize exactly, so rounding recovers every value."""
        eye = torch.eye(self.in_features)
        columns = [self.matmul(eye[a : a + 1024]) for a in range(0, self.in_features, 1024)]
        return torch.round(torch.cat(columns).T / self.scales[:, None]).to(torch.int8)


ROTATION_BLOCK = row_kernel.BLOCK  # channels each `rotate_blocks` Hadamard mixes (the compiled rounding's constant)


@functools.cache
def hadamard(size: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [size, size] (size a power of 2): symmetric, its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)))
    return h / size**0.5


@functools.cache
def _hadamard_numpy(size: int) -> np.ndarray:
    return hadamard(size).numpy()


def rotate_blocks(x: torch.Tensor, block: int = ROTATION_BLOCK) -> torch.Tensor:
    """x [..., K] with every run of `block` channels multiplied by the orthonormal Hadamard (K % block == 0).

    x W^T == rotate_blocks(x) rotate_blocks(W)^T exactly in real numbers: rotating a layer's weight rows
    at load and its input at each call changes nothing but where rounding falls. A row whose size
    sits in a few channels has it spread over the block, so a per-row int8 grid (set by the row's
    largest value) serves the rest of the row better. The rotation is a small float GEMM, which may round a
    row's last bit differently for another row count, as the int8 kernels' own output scaling may."""
    h = hadamard(block).to(device=x.device, dtype=x.dtype)
    return torch.matmul(x.reshape(*x.shape[:-1], x.shape[-1] // block, block), h).reshape(x.shape)


@functools.cache
def has_vnni() -> bool:
    """Whether the CPU has int8 dot products into int32 (AVX-512 VNNI, AVX-VNNI or AMX), from
    /proc/cpuinfo's flags; False where that cannot be read (the safe answer)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def onednn_int8_available() -> bool:
    """Whether this torch build has oneDNN's prepacked int8 linear (x86 builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def int_mm_matches_packed() -> bool:
    """Whether `int8_dynamic_matmul` (`torch._int_mm`) gives `PackedInt8.matmul`'s bits on this CPU, probed
    once per process on a small weight (rows at the grid's ends, rows from 1e-3 to 1e3) at 1, 7 and 32
    rows against one call of 70. Where it does not (some oneDNN builds scale AMX products in another
    order), one kernel serves every call of a layer (`QuantLinear`), so that no row's bits depend on
    which kernel its call's row count picked."""
    if not onednn_int8_available() or not has_vnni():
        return False
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=g) * 0.05
    weight[0] = 1.0
    q, scales = quantize_int8(weight)
    packed, q_t = PackedInt8(q, scales), q.t().contiguous()
    x = torch.randn(70, 256, generator=g) * torch.logspace(-3, 3, 70)[:, None]
    many = packed.matmul(x)
    return all(torch.equal(int8_dynamic_matmul(x[a:b], q_t, scales), many[a:b]) for a, b in ((0, 1), (0, 7), (30, 62)))


def fake_quantize_rows(x: torch.Tensor, steps: float = 127.0) -> torch.Tensor:
    """What the int8-activation kernels do to their input, in float: the reference their tests compare with."""
    codes, peak = quantize_rows(x.reshape(-1, x.shape[-1]), steps)
    return (codes.float() * (peak / steps)).to(x.dtype).reshape(x.shape)


def int4_matmul(x: torch.Tensor, kernel: str, ops: Int4Operands, out_features: int) -> torch.Tensor:
    """x [..., K] @ dequantized int4 weight^T -> [..., N] via the CPU or CUDA int4 kernel."""
    rows = _as_rows(x)
    if kernel == "int4pack_mm_cpu":
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, ops.weight, ops.group_size, ops.scale_and_zero)
    else:
        out = torch.ops.aten._weight_int4pack_mm(rows, ops.weight, ops.group_size, ops.scale_and_zero)
    return out.reshape(*x.shape[:-1], out_features)
