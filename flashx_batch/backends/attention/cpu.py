"""Dense attention on CPU: the SDPA backends with the numba decode kernels of `backends.cpu_decode`
for every one-query read (decode steps over stripes, extents and pages; a packed prefill's last
queries). A read the kernels cannot take (a dtype or layout `cpu_decode.usable` refuses, numba
missing) goes to torch's kernel as the SDPA backend would.
"""

from __future__ import annotations

import torch

from flashx_batch.backends import cpu_decode
from flashx_batch.backends.attention.base import register
from flashx_batch.backends.attention.dense import DecodeSdpa, DenseBackend, PackedSdpa, PagedSdpa
from flashx_batch.backends.attention.meta import Decode


class CpuKernels(DenseBackend):
    def one_query(self, layer, q, keys, values, mask, table=None) -> torch.Tensor:
        batch, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        folded = q.reshape(batch, layer.num_kv_heads, group, layer.head_dim)  # head h -> KV head h // group
        if table is not None:
            if cpu_decode.usable_paged(keys, values):  # pages read where they lie
                out = cpu_decode.attend_paged(folded, keys, values, table, mask, layer.scale)
                return out.reshape(batch, layer.num_heads, 1, layer.head_dim)
            return super().one_query(layer, q, keys, values, mask, table)
        if cpu_decode.usable(keys, values):  # the arena's views on CPU: slot by slot
            out = cpu_decode.attend(folded, keys, values, mask, layer.scale)
            return out.reshape(batch, layer.num_heads, 1, layer.head_dim)
        return super().one_query(layer, q, keys, values, mask)


@register("cpu")
class DecodeCpu(CpuKernels, DecodeSdpa):
    """Rows in extents of their own (`Decode.row_extents`): every row read to its own length in one
    kernel call, not one call per run."""

    def read(self, q, layer, meta: Decode, cache) -> torch.Tensor:
        k_flat, v_flat = cache
        if meta.row_extents is not None and layer.window is None and \
                cpu_decode.usable_paged(k_flat, v_flat, "extents"):
            batch, group = q.shape[0], layer.num_heads // layer.num_kv_heads
            folded = q.reshape(batch, layer.num_kv_heads, group, layer.head_dim)
            out = cpu_decode.attend_rows(folded, k_flat, v_flat, meta.row_extents, layer.scale)
            return out.reshape(batch, layer.num_heads, 1, layer.head_dim)
        return super().read(q, layer, meta, cache)


@register("cpu")
class PagedCpu(CpuKernels, PagedSdpa):
    pass


@register("cpu")
class PackedCpu(CpuKernels, PackedSdpa):
    pass
