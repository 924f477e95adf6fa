"""A pre-quantized checkpoint's linear weights in the row layouts this runtime keeps them in, and the
checked reads (`QuantizedRead`, `check_parts`) the schemes build from safetensors headers.

Each checkpoint format (FP8 blocks, GPTQ / AWQ int4, compressed-tensors int8 / int4 / FP8) is converted
once, at load, into one of three layouts whose rows are output channels, so that the parts a fused
projection is made of (q, k, v; gate, up) concatenate along rows whatever their sizes:

- `Int8Rows`: int8 values [n, K] and one float32 scale per row (symmetric). `activations`: the
  checkpoint was calibrated with activations rounded to int8 per token (W8A8), which our int8 kernel
  does too; weight-only int8 (W8A16) keeps float activations.
- `Int4Rows`: 4-bit values 0..15 [n, K], two to a byte (input channel 2j in the low nibble), a zero point
  0..15 and a scale per (row, group), and each input channel's group (`group`, [K]: contiguous groups, or a
  GPTQ act-order's permuted ones). Weight = (q - zero) * scale.
- `Fp8Rows`: float8_e4m3fn values [n, K] and a float32 scale per (row, block of `block_cols` input
  channels): the checkpoint's block scales repeated down each block's rows, so any row range is
  self-contained (~3 % over the weight's own bytes for 128-wide blocks).

`to_float()` is the float32 weight every layout stands for, computed exactly as the formats' reference
dequantization computes it (integer difference, then one float32 product; FP8 value times its block's
scale): a module that multiplies by it reproduces a float model loaded from the dequantized weights
bit for bit. Conversions run in bounded chunks of rows, so a large linear never exists unpacked to
32-bit integers at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashx_batch.errors import ModelLoadError

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}  # safetensors dtype name -> torch dtype
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of an int32 holds output channel AWQ_ORDER[i] of its 8
_AWQ_UNPACK = [AWQ_ORDER.index(c) for c in range(8)]
_CHUNK_VALUES = 1 << 20  # 4-bit values unpacked per step of a conversion (their int32 temporaries: 4 MB)


@dataclass
class Int8Rows:
    q: torch.Tensor  # int8 [n, K]
    scales: torch.Tensor  # float32 [n]
    activations: bool  # W8A8 (activations rounded to int8 per token) or weight-only

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    def to_float(self) -> torch.Tensor:
        return self.q.float() * self.scales[:, None]


@dataclass
class Int4Rows:
    packed: torch.Tensor  # uint8 [n, ceil(K / 2)]
    zeros: torch.Tensor  # uint8 [n, G], 0..15
    scales: torch.Tensor  # [n, G], as the checkpoint stores them (float16 / bfloat16 / float32)
    group: torch.Tensor  # long [K]: each input channel's group
    in_features: int

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    def values(self) -> torch.Tensor:
        """The 4-bit values [n, K] as uint8."""
        return unpack_pairs(self.packed, self.in_features)

    def to_float(self) -> torch.Tensor:
        diff = self.values().to(torch.int16) - self.zeros.to(torch.int16)[:, self.group]
        return diff.float().mul_(self.scales.float()[:, self.group])


@dataclass
class Fp8Rows:
    q: torch.Tensor  # float8_e4m3fn [n, K]
    scales: torch.Tensor  # float32 [n, ceil(K / block_cols)]
    block_cols: int

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    def to_float(self) -> torch.Tensor:
        width = self.q.shape[1]
        return self.q.float().mul_(self.scales.repeat_interleave(self.block_cols, dim=1)[:, :width])


RowLayout = Int8Rows | Int4Rows | Fp8Rows


def concat_rows(parts: list[RowLayout]) -> RowLayout | None:
    """The parts of a fused projection as one layout (rows in order), or None where they cannot share one:
    different layouts, widths, group sizes or act-orders, W8A8 next to weight-only."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(type(p) is not type(first) for p in parts):
        return None
    if isinstance(first, Int8Rows):
        if any(p.activations != first.activations or p.q.shape[1] != first.q.shape[1] for p in parts):
            return None
        return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), first.activations)
    if isinstance(first, Int4Rows):
        if any(p.in_features != first.in_features or p.zeros.shape[1] != first.zeros.shape[1]
               or p.scales.dtype != first.scales.dtype or not torch.equal(p.group, first.group) for p in parts):
            return None
        return Int4Rows(torch.cat([p.packed for p in parts]), torch.cat([p.zeros for p in parts]),
                        torch.cat([p.scales for p in parts]), first.group, first.in_features)
    if any(p.block_cols != first.block_cols or p.q.shape[1] != first.q.shape[1] for p in parts):
        return None
    return Fp8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), first.block_cols)


def pack_pairs(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [n, K] -> [n, ceil(K / 2)], input channel 2j in the low nibble of byte j."""
    if values.shape[1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_pairs(packed: torch.Tensor, width: int) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)[:, :width]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> its eight 4-bit values [..., n, 8] as uint8, lowest nibble first."""
    return ((packed[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)


def groups_of(in_features: int, group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Each input channel's group: `g_idx` where the checkpoint has one, else contiguous groups (one for -1)."""
    if g_idx is not None:
        return g_idx.long()
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.long)
    return torch.arange(in_features) // group_size


def _columns_per_chunk(rows: int) -> int:
    return max(8, _CHUNK_VALUES // max(rows, 1) // 8 * 8)


def gptq_rows(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group_size: int, zeros_minus_one: bool) -> Int4Rows:
    """A GPTQ linear (qweight int32 [K / 8, N], input channel 8i + s at nibble s of row i; qzeros int32
    [G, N / 8]; scales [G, N]) in `Int4Rows`. v1 checkpoints store each zero-point word minus 0x11111111
    (a zero point of 0 borrows from its neighbour): added back as a word."""
    words, out = qweight.shape
    width = words * 8
    packed = torch.empty(out, -(-width // 2), dtype=torch.uint8)
    step = _columns_per_chunk(width)
    for first in range(0, out, step):
        block = qweight[:, first : first + step]  # [K / 8, c]
        values = _nibbles(block).permute(1, 0, 2).reshape(block.shape[1], width)  # [c, K]
        packed[first : first + step] = pack_pairs(values)
    if zeros_minus_one:
        qzeros = ((qzeros.to(torch.int64) + 0x11111111) & 0xFFFFFFFF).to(torch.int32)  # wraps like the int32 sum
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1)[:, :out].t().contiguous()
    return Int4Rows(packed, zeros, scales.t().contiguous(), groups_of(width, group_size, g_idx), width)


def awq_rows(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Rows:
    """An AWQ GEMM linear (qweight int32 [K, N / 8], output channels in AWQ_ORDER within each int32; qzeros
    int32 [G, N / 8] the same way; scales [G, N]) in `Int4Rows`."""
    width, words = qweight.shape
    out = words * 8
    packed = torch.empty(out, -(-width // 2), dtype=torch.uint8)
    step = max(1, _columns_per_chunk(width) // 8)  # packed columns (8 outputs each) per chunk
    for first in range(0, words, step):
        values = _nibbles(qweight[:, first : first + step])[..., _AWQ_UNPACK].reshape(width, -1)  # [K, 8c]
        packed[first * 8 : (first + step) * 8] = pack_pairs(values.t())
    zeros = _nibbles(qzeros)[..., _AWQ_UNPACK].reshape(qzeros.shape[0], -1).t().contiguous()
    return Int4Rows(packed, zeros, scales.t().contiguous(), groups_of(width, group_size), width)


def fp8_block_rows(q: torch.Tensor, scale_table: torch.Tensor, block_rows: int, block_cols: int) -> Fp8Rows:
    """FP8 values [N, K] with one scale per `block_rows` x `block_cols` block ([ceil(N / rows), ceil(K / cols)])."""
    rows = torch.arange(q.shape[0]) // block_rows
    return Fp8Rows(q, scale_table.float()[rows].contiguous(), block_cols)


Source = tuple[Path, str]  # (safetensors file, tensor name)
Headers = dict[Path, dict]  # file -> its safetensors header (tensor name -> dtype, shape, data_offsets)


@dataclass(frozen=True)
class QuantizedRead:
    """One quantized linear as the loader reads it: the float weight's [out, in] `shape` and the checkpoint
    tensors it is made of (`parts`: role -> where), for its scheme's `layout`."""

    shape: tuple[int, int]
    parts: dict[str, Source]
    detail: object = None  # what the scheme needs beyond the tensors (compressed-tensors: the module's arguments)


def header_shape(info: dict) -> tuple[int, ...]:
    return tuple(int(d) for d in info["shape"])


FLOAT_SCALES = ("F32", "BF16", "F16")


def check_parts(path: Path, hf_name: str, base: str, want: dict[str, tuple[str | None, tuple[int, ...]]],
                located: dict[str, Path], headers: Headers, what: str) -> dict[str, Source]:
    """Where each of a linear's other tensors (`base` + part) is, each checked for its dtype (None: a float
    one) and shape; ModelLoadError naming the first missing or mismatched one."""
    parts: dict[str, Source] = {}
    for part, (dtype, shape) in want.items():
        name = base + part
        if name not in located:
            raise ModelLoadError(f"{path.name}:{hf_name}: its {name} is missing; is a shard file missing?")
        got = headers[located[name]][name]
        wrong_dtype = got.get("dtype") != dtype if dtype is not None else got.get("dtype") not in FLOAT_SCALES
        if header_shape(got) != shape or wrong_dtype:
            raise ModelLoadError(f"{located[name].name}:{name}: {got.get('dtype')} {got['shape']}, but {hf_name} "
                                 f"{what} needs {dtype or 'float'} {list(shape)}.")
        parts[part] = (located[name], name)
    return parts


def check_groups(layout: Int4Rows, source: Source | None) -> None:
    """Every input channel's group index names one of the layout's groups (a checkpoint's `g_idx` is data:
    its values are only known once read); ModelLoadError naming the tensor."""
    groups = layout.zeros.shape[1]
    if len(layout.group) and (int(layout.group.min()) < 0 or int(layout.group.max()) >= groups):
        where = f"{source[0].name}:{source[1]}" if source else "group indices"
        raise ModelLoadError(f"{where}: group indices {int(layout.group.min())}..{int(layout.group.max())}, but the "
                             f"linear has {groups} groups of scales and zero points; the checkpoint is damaged.")
