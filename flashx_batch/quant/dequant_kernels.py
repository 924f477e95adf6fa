"""Host kernels that dequantize a kept checkpoint weight (`quant.checkpoint_linear.DequantizingLinear`) into a
float32 buffer, rows in parallel, for a BLAS matmul to read.

As torch ops the same dequantization is eight passes over the weight, each with a weight-sized temporary
(unpack, widen, gather zero points, subtract, convert, gather scales, multiply): a decode step then ran
~9x slower than the float32 model. Here each row is one pass that reads the packed bytes and writes
floats, into one buffer reused by every call (`dequantize_into`): the values are bit for bit those of
`models.quantized_rows`' `to_float()` (the integer difference, then one float32 product; an FP8 value is
read from a table of all 256 codes), so the matmul that follows is the float model's, bit for bit.
Compiled with numba on first use (cached on disk where writable); where numba is missing or fails, None,
and the torch ops serve every call.
"""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import torch

from flashx_batch.backends.cpu_decode import compile_kernel, load_numba, parallel_region

log = logging.getLogger("flashx_batch.quant.dequant_kernels")
_local = threading.local()  # each thread's reusable float32 buffer (engines in threads never share one)
BUFFER_VALUES = 8 << 20  # a buffer's float32 values at most (32 MiB): larger weights dequantize in row blocks


@functools.cache
def kernels():
    """(int4 with contiguous groups, int4 with a group per input channel, FP8) compiled, or None."""
    numba = load_numba("kept checkpoint weights dequantize through torch ops")
    if numba is None:
        return None
    prange = numba.prange

    # Each row through 1-D views of it: numba vectorizes these loops (indexing the 2-D arrays in the loop
    # body measured 4x slower). No fast-math: the products must round as torch's do.
    def int4_grouped(packed, zeros, scales, group_size, out):  # pragma: no cover - compiled
        # group_size even: a group starts on a byte, so its values come two to a byte. Whole groups in a
        # fixed-length loop (what vectorizes), then what a partial last group or an odd width leaves.
        rows, width = out.shape
        half, whole = group_size // 2, width // group_size
        for n in prange(rows):
            row, source = out[n], packed[n]
            for g in range(whole):
                scale, zero, base = scales[n, g], np.int32(zeros[n, g]), g * half
                for j in range(half):
                    byte = np.int32(source[base + j])
                    row[2 * (base + j)] = np.float32((byte & 15) - zero) * scale
                    row[2 * (base + j) + 1] = np.float32((byte >> 4) - zero) * scale
            if whole < zeros.shape[1]:
                scale, zero = scales[n, whole], np.int32(zeros[n, whole])
                for k in range(whole * group_size, width):
                    byte = np.int32(source[k >> 1])
                    row[k] = np.float32(((byte >> 4) if k & 1 else (byte & 15)) - zero) * scale

    def int4_indexed(packed, zeros, scales, group, out):  # pragma: no cover - compiled
        rows, width = out.shape
        for n in prange(rows):
            row, source, zero_row, scale_row = out[n], packed[n], zeros[n], scales[n]
            for k in range(width):
                g = group[k]
                byte = np.int32(source[k >> 1])
                value = (byte >> 4) if k & 1 else (byte & 15)
                row[k] = np.float32(value - np.int32(zero_row[g])) * scale_row[g]

    def fp8_blocks(codes, table, scales, block_cols, out):  # pragma: no cover - compiled
        rows, width = out.shape
        whole = width // block_cols
        for n in prange(rows):
            row, source = out[n], codes[n]
            for b in range(whole):
                scale, base = scales[n, b], b * block_cols
                for j in range(block_cols):
                    row[base + j] = table[source[base + j]] * scale
            for k in range(whole * block_cols, width):
                row[k] = table[source[k]] * scales[n, whole]

    try:
        compiled = tuple(compile_kernel(numba, kernel, parallel=True)
                         for kernel in (int4_grouped, int4_indexed, fp8_blocks))
        probe = np.zeros((2, 4), np.float32)
        ones = np.ones((2, 1), np.float32)
        with parallel_region(numba):
            compiled[0](np.zeros((2, 2), np.uint8), np.zeros((2, 1), np.uint8), ones, 4, probe)
            compiled[1](np.zeros((2, 2), np.uint8), np.zeros((2, 1), np.uint8), ones, np.zeros(4, np.int64), probe)
            compiled[2](np.zeros((2, 4), np.uint8), np.ones(256, np.float32), ones, 4, probe)
    except Exception as exc:  # a numba that cannot compile here
        log.warning("dequantization kernels failed to compile (%s): torch ops serve every call", exc)
        return None
    return numba, compiled


FP8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def buffer(rows: int, width: int) -> torch.Tensor:
    """A float32 [rows, width] view of this thread's buffer, grown to the largest block asked for."""
    held = getattr(_local, "buffer", None)
    if held is None or held.numel() < rows * width:
        held = _local.buffer = torch.empty(rows * width, dtype=torch.float32)
    return held[: rows * width].view(rows, width)


def block_rows(rows: int, width: int) -> int:
    """Rows of a weight dequantized at once: all of them up to `BUFFER_VALUES` floats, else blocks that fit."""
    return rows if rows * width <= BUFFER_VALUES else max(1, BUFFER_VALUES // width)


def dequantize_into(out: torch.Tensor, fmt: str, parts: dict, contiguous_groups: int | None, first: int = 0) -> bool:
    """Fill `out` (float32 [n, K], host memory) with rows first..first + n of the weight; False where the kernels
    are unavailable. `parts`: the module's buffers (int4: packed, zeros, scales as float32, group; fp8: q,
    scales, block_cols); `contiguous_groups`: the group size where input channel k is in group k // size
    (else `group` is read)."""
    ready = kernels()
    if ready is None:
        return False
    numba, (int4_grouped, int4_indexed, fp8_blocks) = ready
    rows = slice(first, first + out.shape[0])
    target = out.numpy()
    with parallel_region(numba):  # the package's one lock for numba's parallel regions
        if fmt == "fp8":
            fp8_blocks(parts["q"][rows].view(torch.uint8).numpy(), FP8_TABLE, parts["scales"][rows].numpy(),
                       parts["block_cols"], target)
        elif contiguous_groups is not None:
            int4_grouped(parts["packed"][rows].numpy(), parts["zeros"][rows].numpy(), parts["scales"][rows].numpy(),
                         contiguous_groups, target)
        else:
            int4_indexed(parts["packed"][rows].numpy(), parts["zeros"][rows].numpy(), parts["scales"][rows].numpy(),
                         parts["group"].numpy(), target)
    return True
