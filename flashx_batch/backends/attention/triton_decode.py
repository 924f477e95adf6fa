"""Decode attention for rows in extents of their own, as one Triton kernel launch per layer: no mask tensor,
no strided view per run of rows, each row read exactly to its own length.

The flat cache is the arena's layer view, keys and values [slots, Hkv, D]; row r's keys are the `lengths[r]`
slots from flat slot `starts[r]` on. One program serves one (row, KV head): its `group` query heads (the
heads that share that KV head) walk the row's slots a block at a time with an online softmax (running max,
running sum), so the cache is read once per KV head and nothing of size rows x slots is ever built. Sums in
float32 whatever the cache dtype.

Written for GPUs (CUDA, ROCm), where the striped SDPA path builds per-step masks and launches one
attention per run; tested on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`, set before this
module is imported) against torch's attention, and end to end as the decode backend of a CPU engine (tokens
equal). `available()` says whether Triton imports here.

`DecodeTriton` registers it for CUDA devices: a decode step whose runner hands it the rows' extents
(`Decode.row_extents`) reads them here; `PagedTriton` reads a paged batch's decode step through its slot
tables (the mask as a bias, no gather); any other read (stripes, sliding layers, no Triton) goes to SDPA as
before. Not yet done: the GPU runner builds those extents without a device-to-host copy (today only host
runners build them, so on a GPU this backend still reads through SDPA), and the GPU measurements.
"""

from __future__ import annotations

import functools
import logging

import torch

from flashx_batch.backends import cpu_decode
from flashx_batch.backends.attention.base import register
from flashx_batch.backends.attention.dense import DecodeSdpa, PagedSdpa
from flashx_batch.backends.attention.meta import Decode

log = logging.getLogger(__name__)
BLOCK_SLOTS = 64  # slots a program reads per step of its loop


@functools.cache
def _kernel():
    """The jitted kernel, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # an ImportError, or a Triton that cannot load here
        return None

    @triton.jit
    def extents_decode(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, lengths_ptr, table_ptr, bias_ptr, scale,
                       stride_q_row, stride_q_head, stride_q_group,
                       stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_table, stride_bias,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                       BLOCK: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_BIAS: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        start = tl.load(starts_ptr + row)
        length = tl.load(lengths_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        gd_ok = (g[:, None] < GROUP) & (d[None, :] < DIM)
        q_offsets = row * stride_q_row + head * stride_q_head + g[:, None] * stride_q_group + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=gd_ok, other=0.0).to(tl.float32)  # [G, D]
        peak = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
        n = tl.arange(0, BLOCK)
        for first in range(0, length, BLOCK):
            slot_ok = (first + n) < length
            if HAS_TABLE:  # a paged row: position j of the row lies in flat slot table[row, j]
                slots = tl.load(table_ptr + row * stride_table + first + n, mask=slot_ok, other=0)
            else:
                slots = start + first + n
            kv_ok = slot_ok[:, None] & (d[None, :] < DIM)
            keys = tl.load(k_ptr + slots[:, None] * stride_k_slot + head * stride_k_head + d[None, :],
                           mask=kv_ok, other=0.0).to(tl.float32)  # [N, D]
            values = tl.load(v_ptr + slots[:, None] * stride_v_slot + head * stride_v_head + d[None, :],
                             mask=kv_ok, other=0.0).to(tl.float32)
            # a decode step's few query heads: products summed over D, no minimum tile for tl.dot
            scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [G, N]
            if HAS_BIAS:  # a mask as an additive bias per position of the row (-inf: hidden)
                scores += tl.load(bias_ptr + row * stride_bias + first + n, mask=slot_ok, other=0.0)[None, :]
            scores = tl.where(slot_ok[None, :], scores, float("-inf"))
            new_peak = tl.maximum(peak, tl.max(scores, axis=1))
            # a block (or more) with every position hidden leaves the peak at -inf: shift by 0 instead
            shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
            rescale = tl.exp(peak - shift)
            weights = tl.exp(scores - shift[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
            peak = new_peak
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # every position hidden: zeros
        out_offsets = row * stride_q_row + head * stride_q_head + g[:, None] * stride_q_group + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=gd_ok)

    return triton, extents_decode


def available() -> bool:
    return _kernel() is not None


@functools.cache
def usable(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether the kernel runs on this device for this cache dtype: Triton present, and the kernel compiled and
    checked against `reference` on a small case there, once. A failure is logged and SDPA serves instead."""
    if not available():
        return False
    device = torch.device(device_type, device_index)
    try:
        g = torch.Generator().manual_seed(0)
        keys, values = (torch.randn(80, 2, 64, generator=g).to(device, dtype) for _ in range(2))
        q = torch.randn(2, 2, 2, 64, generator=g).to(device, dtype)
        starts, lengths = torch.tensor([0, 10], device=device), torch.tensor([70, 3], device=device)
        got = attend_extents(q, keys, values, starts, lengths, 0.125).float()
        want = reference(q, keys, values, starts, lengths, 0.125).float()
        if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
            raise RuntimeError(f"it differs from torch's attention by {(got - want).abs().max().item():.3g}")
    except Exception as exc:  # a compiler or driver error on this platform: never fatal, only slower
        log.warning("Triton extents decode kernel unavailable on %s for %s (%s): SDPA serves those reads", device,
                    dtype, exc)
        return False
    return True


def attend_extents(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                   lengths: torch.Tensor, scale: float, table: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hkv, G, D] (query head h = kv_head * G + g), keys / values the flat cache [slots, Hkv, D] on
    q's device, starts / lengths [B] (int32 or int64, each length at least 1) -> [B, Hkv, G, D] in q's dtype.

    With `table` [B, L] (a paged batch's slot table) row r's position j lies in flat slot table[r, j] and
    `starts` is not read; with `bias` [B, >= L] float32, added to row r's score at position j (-inf hides it;
    a row with every position hidden gives zeros)."""
    ready = _kernel()
    if ready is None:
        raise RuntimeError("Triton is not installed: the extents decode kernel cannot run")
    triton, kernel = ready
    rows, heads, group, dim = q.shape
    if keys.shape[1:] != (heads, dim) or values.shape != keys.shape:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit queries "
                         f"{tuple(q.shape)} ([slots, {heads}, {dim}] wanted)")
    if starts.shape != (rows,) or lengths.shape != (rows,):
        raise ValueError(f"starts {tuple(starts.shape)} / lengths {tuple(lengths.shape)}: one per row ({rows}) wanted")
    if keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError("each slot's head vectors must be contiguous (stride 1 along D)")
    q = q.contiguous()
    out = torch.empty_like(q)
    if rows == 0:
        return out
    has_table, has_bias = table is not None, bias is not None
    if has_table and (table.dim() != 2 or table.shape[0] != rows or lengths.max() > table.shape[1]):
        raise ValueError(f"slot table {tuple(table.shape)} does not cover {rows} rows of up to {int(lengths.max())}")
    if has_bias and (bias.dim() != 2 or bias.shape[0] != rows or bias.stride(1) != 1
                     or lengths.max() > bias.shape[1] or bias.dtype != torch.float32):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype}: float32 [{rows}, >= row length] wanted")
    kernel[(rows, heads)](q, keys, values, out, starts, lengths, table if has_table else starts,
                          bias if has_bias else q, float(scale),
                          q.stride(0), q.stride(1), q.stride(2),
                          keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
                          table.stride(0) if has_table else 0, bias.stride(0) if has_bias else 0,
                          GROUP=group, GROUP_PAD=max(1, triton.next_power_of_2(group)), DIM=dim,
                          DIM_PAD=max(16, triton.next_power_of_2(dim)), BLOCK=BLOCK_SLOTS,
                          HAS_TABLE=has_table, HAS_BIAS=has_bias)
    return out


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
              lengths: torch.Tensor, scale: float, table: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same read through torch, one row at a time in float32 (what the tests compare with)."""
    rows, heads, group, dim = q.shape
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(rows):
        first, count = int(starts[r]), int(lengths[r])
        slots = table[r, :count].long() if table is not None else torch.arange(first, first + count, device=q.device)
        k = keys[slots].float().transpose(0, 1)  # [Hkv, L, D]
        v = values[slots].float().transpose(0, 1)
        scores = torch.einsum("hgd,hld->hgl", q[r].float(), k) * scale
        if bias is not None:
            scores = scores + bias[r, :count]
        out[r] = torch.einsum("hgl,hld->hgd", scores.softmax(-1), v)
    return out.to(q.dtype)


@register("cuda")
class DecodeTriton(DecodeSdpa):
    """Decode steps over rows in extents (`Decode.row_extents`) through `attend_extents`, one launch per layer;
    every other read as `DecodeSdpa` reads it."""

    def read(self, q, layer, meta: Decode, cache) -> torch.Tensor:
        rows = meta.row_extents
        k_flat, v_flat = cache
        if rows is None or layer.window is not None or not usable(q.device.type, q.device.index, k_flat.dtype):
            return super().read(q, layer, meta, cache)
        batch, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        folded = q.reshape(batch, layer.num_kv_heads, group, layer.head_dim)  # head h -> KV head h // group
        starts, lengths = rows.on(q.device)
        out = attend_extents(folded, k_flat, v_flat, starts, lengths, layer.scale)
        return out.reshape(batch, layer.num_heads, 1, layer.head_dim)


@register("cuda")
class PagedTriton(PagedSdpa):
    """A paged batch's decode step (rows reading shared prefix segments through slot tables) through the same
    kernel, each row's positions looked up in its table row, its mask as a bias: no gather of the keys."""

    def one_query(self, layer, q, keys, values, mask, table=None) -> torch.Tensor:
        if table is None or layer.window is not None or not usable(q.device.type, q.device.index, keys.dtype):
            return super().one_query(layer, q, keys, values, mask, table)
        batch, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        folded = q.reshape(batch, layer.num_kv_heads, group, layer.head_dim)
        slots = table.shape[1]
        lengths = torch.full((batch,), slots, dtype=torch.int64, device=q.device)
        out = attend_extents(folded, keys, values, lengths, lengths, layer.scale, table=table.contiguous(),
                             bias=cpu_decode.bias_rows(mask, batch, slots))
        return out.reshape(batch, layer.num_heads, 1, layer.head_dim)
