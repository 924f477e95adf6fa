"""Decode attention on CPU: one new query per row against that row's cached keys, read slot by slot.

The arena stores a row's cache as [slot, kv_head, dim]. torch's CPU attention kernel walks it one
(row, head) pair at a time: every decode step pays a fixed cost per pair (small GEMMs, buffers) and
strides through each row's memory once per head, so the step costs what the rows times heads cost,
not what the bytes do. This kernel reads each slot of a row once, all its heads together (one
contiguous run of memory), in two passes (scores, then the softmax-weighted values), one row per
thread (with fewer rows than threads, each row's heads shared out among them). The gain per shape:
`python -m flashx_batch.bench.cpu_decode` (docs/benchmarks.md, "CPU decode attention").

Compiled with numba (a dependency of the package) on first use and cached on disk next to this file
(or numba's user cache where that is read-only). `usable` says whether a call takes this path: CPU
tensors; a float32 cache, or bfloat16 (widened to float32 as it is read) with head_dim >= 64, below
which torch's bfloat16 kernel is as fast; a layout whose rows are evenly spaced whole slots with
contiguous heads (the arena's stripes, extents and gathered pages). Anything else, or numba failing
to import, goes to `F.scaled_dot_product_attention` as before.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import numpy as np
import torch

log = logging.getLogger("flashx_batch.models.cpu_decode")

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _kernel():
    """The compiled kernel, or None where numba is missing or broken (then SDPA serves every call)."""
    try:
        import numba
        from numba import njit, prange
        from numba.extending import overload
    except Exception as exc:  # an ImportError, or numba refusing this numpy: never fatal, only slower
        log.warning("numba unavailable (%s): CPU decode attention falls back to torch's kernel", exc)
        return None
    # OpenMP first, as torch's CPU kernels: numba's own work queue hands each call to its threads
    # far more slowly (the benchmark reads it with NUMBA_THREADING_LAYER=workqueue). Set before the
    # first parallel call, which is when numba picks its layer; an explicit setting is left alone.
    if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

    def widen(src, buf):  # pragma: no cover - replaced by the overload inside compiled code
        raise NotImplementedError

    @overload(widen)
    def _widen(src, buf):
        """One slot's [Hkv, D] as float32: float32 as it is, bfloat16 bits (the upper half of a
        float32) shifted into `buf`."""
        if src.dtype == numba.types.uint16:
            def impl(src, buf):
                bits = buf.view(np.uint32)
                for h in range(src.shape[0]):
                    for d in range(src.shape[1]):
                        bits[h, d] = np.uint32(src[h, d]) << np.uint32(16)
                return buf
            return impl
        return lambda src, buf: src

    @njit(parallel=True, fastmath=True, cache=True)
    def attend(q, keys, values, slots, bias, scale, parts, out):  # pragma: no cover - compiled
        rows, kv_heads, group, dim = q.shape
        span = (kv_heads + parts - 1) // parts
        for job in prange(rows * parts):  # one row's KV heads [first, last) per job
            r, first = job // parts, (job % parts) * span
            last = min(kv_heads, first + span)
            heads = max(0, last - first)
            buf = np.empty((heads, dim), np.float32)
            scores = np.empty((slots, heads, group), np.float32)
            peak = np.full((heads, group), -np.inf, np.float32)
            for s in range(slots):
                k = widen(keys[r, s, first:last], buf)
                add = bias[r, s] if bias.shape[0] else np.float32(0.0)
                for h in range(heads):
                    for g in range(group):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += q[r, first + h, g, d] * k[h, d]
                        x = acc * scale + add
                        scores[s, h, g] = x
                        peak[h, g] = max(peak[h, g], x)
            total = np.zeros((heads, group), np.float32)
            acc_out = np.zeros((heads, group, dim), np.float32)
            for s in range(slots):
                v = widen(values[r, s, first:last], buf)
                for h in range(heads):
                    for g in range(group):
                        p = np.exp(scores[s, h, g] - peak[h, g])
                        total[h, g] += p
                        for d in range(dim):
                            acc_out[h, g, d] += p * v[h, d]
            for h in range(heads):
                for g in range(group):
                    for d in range(dim):
                        out[r, first + h, g, d] = acc_out[h, g, d] / total[h, g]

    return numba, attend


def usable(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `attend` serves keys and values [B, Hkv, L, D] laid out as the arena's strided views
    are: on the CPU, float32 or bfloat16, each slot's heads side by side (head stride D, slot stride
    Hkv * D), rows a whole number of slots apart, values strided as keys. Checked before `_kernel()`,
    so other devices never import numba."""
    if keys.device.type != "cpu" or keys.dtype not in _DTYPES or keys.dim() != 4:
        return False
    if values.dtype != keys.dtype or values.shape != keys.shape or values.stride() != keys.stride():
        return False
    _, heads, _, dim = keys.shape
    if keys.dtype == torch.bfloat16 and dim < 64:  # torch's own bfloat16 kernel is as fast there
        return False
    slot = heads * dim
    ok = keys.stride(3) == 1 and keys.stride(1) == dim and keys.stride(2) == slot and keys.stride(0) % slot == 0
    # the kernel views whole rows (`_stripes`): the last one must lie inside the storage too
    end = keys.storage_offset() + keys.shape[0] * keys.stride(0)
    ok = ok and end <= keys.untyped_storage().nbytes() // keys.element_size()
    return ok and _kernel() is not None


def _stripes(t: torch.Tensor) -> np.ndarray:
    """A view [B, Hkv, L, D] as the whole rows it cuts from, [B, row stride / slot stride, Hkv, D]: a
    C-contiguous numpy array over the same memory (zero copy; bfloat16 as its uint16 bits). The kernel
    reads the first L slots of each row."""
    rows, heads, _, dim = t.shape
    whole = t.as_strided((rows, t.stride(0) // t.stride(2), heads, dim), (t.stride(0), t.stride(2), dim, 1))
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: the kernel widens the bits itself
        return whole.view(torch.int16).numpy().view(np.uint16)
    return whole.numpy()


def _bias(mask: torch.Tensor | None, rows: int, slots: int) -> np.ndarray:
    """The mask as the kernel's additive float32 [rows, slots] (empty: no mask), read as SDPA reads it:
    a boolean mask keeps the True slots, any other dtype is added to the scores."""
    if mask is None:
        return np.zeros((0, 0), np.float32)
    mask = mask.expand(rows, 1, 1, mask.shape[-1])[:, 0, 0, :slots]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    return mask.float().contiguous().numpy()


def head_parts(rows: int, heads: int, threads: int) -> int:
    """Into how many parts each row's KV heads are cut, one part per parallel job. With fewer rows
    than threads (one long row at the end of a batch) the heads are shared out so that the other
    threads do not sit idle; otherwise a row's heads stay together (each slot read once)."""
    return min(heads, -(-threads // rows)) if rows < threads else 1


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """q [B, Hkv, G, D] (the G query heads of each KV head), keys / values [B, Hkv, L, D] (`usable`),
    mask None, additive or boolean (True: attend), broadcastable to [B, 1, 1, L] -> [B, Hkv, G, D] in
    q's dtype. Softmax in float32."""
    numba, kernel = _kernel()
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    rows, heads, slots, dim = keys.shape
    parts = head_parts(rows, heads, threads)
    query = q.to(torch.float32).contiguous()
    out = torch.empty(query.shape, dtype=torch.float32)
    kernel(query.numpy(), _stripes(keys), _stripes(values), slots, _bias(mask, rows, slots), np.float32(scale),
           parts, out.numpy())
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def warm_up() -> None:
    """Compile (or load from the on-disk cache) both kernels now, so the first decode step of a job
    does not pay for it."""
    for dtype in _DTYPES:
        keys = torch.zeros(1, 1, 1, 4, dtype=dtype)
        if usable(keys, keys):
            attend(torch.zeros(1, 1, 1, 4, dtype=dtype), keys, keys, None, 1.0 / math.sqrt(4))
