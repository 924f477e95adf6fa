"""Per-row int8 rounding of a few activation rows in one compiled pass (CPU, float32).

`formats.quantize_rows` rounds each row of a linear layer's input on its own grid before the int8
GEMM. With torch ops that is eight small kernels (|x|, row maximum, clamp, reciprocal, two scalings,
round, the int8 copy) plus the uint8 shift of the prepacked path: at a decode step's few rows each
costs its fixed dispatch (the per-call figures: docs/benchmarks.md, "Ours against CTranslate2 and
llama.cpp"). This kernel does the same rounding in one pass per row: each row's absolute maximum, then
its codes, already shifted by the caller's zero point. Used for inputs of up to `formats._SMALL_ROWS`
values (decode); larger ones stay on torch's multithreaded ops, where passes over memory are the
cost. Compiled with numba on first use (cached on disk where the package directory or numba's user
cache is writable); where numba is missing or fails, None, and the torch ops serve every call.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

log = logging.getLogger("flashx_batch.quant.row_kernel")


@functools.cache
def kernel():
    """The compiled `round_rows(rows, steps, offset, codes, peak)`, or None (torch ops serve then)."""
    try:
        import numba
    except Exception as exc:  # never fatal, only slower
        log.info("numba unavailable (%s): int8 activation rounding runs as torch ops", exc)
        return None

    def round_rows(rows, steps, offset, codes, peak):  # pragma: no cover - compiled
        """rows float32 [M, K] -> codes uint8 [M, K] = round(x * steps / peak) + offset (modulo 256),
        peak [M, 1] = the row's absolute maximum (at least 1e-12). A row holding NaN or infinity
        gets that as its peak and zero codes (its output is NaN / infinite again once scaled)."""
        count, width = rows.shape
        for i in range(count):
            top = np.float32(0.0)
            finite = True
            for j in range(width):
                a = abs(rows[i, j])
                if not a < np.inf:  # NaN or infinity
                    finite = False
                    top = a
                    break
                if a > top:
                    top = a
            if finite and top < np.float32(1e-12):
                top = np.float32(1e-12)
            peak[i, 0] = top
            if not finite:
                for j in range(width):
                    codes[i, j] = np.uint8(offset & 255)
                continue
            # as the torch ops compute it, (1 / peak) * steps in float32: a row rounds the same on either path
            inv = (np.float32(1.0) / top) * np.float32(steps)
            for j in range(width):
                codes[i, j] = np.uint8((np.int32(np.rint(rows[i, j] * inv)) + offset) & 255)

    try:
        try:
            compiled = numba.njit(cache=True)(round_rows)
        except RuntimeError:  # no writable cache location (a read-only install): compile in each process
            compiled = numba.njit(round_rows)
        rows = np.array([[0.5, -1.0], [0.0, 0.0]], np.float32)
        codes, peak = np.empty((2, 2), np.uint8), np.empty((2, 1), np.float32)
        compiled(rows, 127.0, 0, codes, peak)
        if codes[0].tolist() != [64, 129] or peak[:, 0].tolist() != [1.0, np.float32(1e-12)]:
            raise RuntimeError(f"the compiled kernel rounded {rows.tolist()} to {codes.tolist()}, {peak.tolist()}")
    except Exception as exc:  # a compiler error on this platform: never fatal, only slower
        log.warning("int8 row rounding kernel unavailable (%s): torch ops round activations", exc)
        return None
    return compiled
