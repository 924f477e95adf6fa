"""Per-row int8 rounding of a few activation rows in one compiled pass (CPU, float32).

`formats.quantize_rows` rounds each row of a linear layer's input on its own grid before the int8
GEMM. With torch ops that is eight small kernels (|x|, row maximum, clamp, reciprocal, two scalings,
round, the int8 copy) plus the uint8 shift of the prepacked path, and a rotated input (a down
projection's, `formats.rotate_blocks`) one GEMM more over a strided copy: at a decode step's few rows
each costs its fixed dispatch (the per-call figures: docs/benchmarks.md, "Ours against CTranslate2 and
llama.cpp"). `kernel` does the same in one pass per row: the rotation, each row's absolute maximum,
then its codes, already shifted by the caller's zero point: the torch ops' bits. Used for up to
`formats._SMALL_ROWS` values (decode); larger calls stay on torch's multithreaded ops, where passes
over memory are the cost. Compiled with numba on first use (cached on disk where the package
directory or numba's user cache is writable); where numba is missing or fails, None, and the torch
ops serve every call.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from flashx_batch.backends.cpu_decode import compile_kernel

log = logging.getLogger("flashx_batch.quant.row_kernel")

NO_ROTATION = np.zeros((0, 0), np.float32)  # `round_rows`' hadamard when rows are rounded as they are
BLOCK = 16  # channels the rotation mixes (`formats.ROTATION_BLOCK`), a constant of the compiled code


# Stubs numba replaces inside compiled code with the overloads `register` gives them. Module-level, so
# other compiled kernels (`quant.int8_decode`) call the same rounding; overloads rather than jitted
# functions a kernel closes over: numba's on-disk cache keys a closure by its variables, and a
# dispatcher's pickled form differs in every process (a fresh compile each time).
def rotate(rows, hadamard, out):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


def largest(row):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


def round_row(row, steps, offset, codes):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@functools.cache
def register():
    """Import numba and give the stubs above their compiled implementations; the numba module, or
    None where numba is missing (the callers' torch paths serve then)."""
    try:
        import numba
    except Exception as exc:  # never fatal, only slower
        log.info("numba unavailable (%s): int8 activation rounding runs as torch ops", exc)
        return None

    from numba.extending import overload

    block = BLOCK

    @overload(rotate)
    def _rotate(rows, hadamard, out):
        """out = each run of `block` channels of rows times hadamard [block, block], one output at a time
        (its sum in a register, the block a constant the compiler unrolls: 6x faster than a running sum
        in memory)."""
        def impl(rows, hadamard, out):
            count, width = rows.shape
            for i in range(count):
                for a in range(0, width, block):
                    for j in range(block):
                        total = rows[i, a] * hadamard[0, j]
                        for k in range(1, block):
                            total += rows[i, a + k] * hadamard[k, j]
                        out[i, a + j] = total
        return impl

    @overload(largest, jit_options={"fastmath": {"nnan", "nsz", "reassoc"}})
    def _largest(row):
        """The largest |value| of a finite row: a maximum the compiler vectorizes only when told no NaN
        comes (rows that hold one are told apart before their peak is read)."""
        def impl(row):
            top = np.float32(0.0)
            for j in range(row.shape[0]):
                top = max(top, abs(row[j]))
            return top
        return impl

    @overload(round_row)
    def _round_row(row, steps, offset, codes):
        """One row float32 [K] -> codes uint8 [K] = round(x * steps / peak) + offset (modulo 256); returns
        the peak, the row's absolute maximum (at least 1e-12). A row holding NaN or infinity gets that as
        its peak and zero codes (its output is NaN / infinite again once scaled)."""
        def impl(row, steps, offset, codes):
            width = row.shape[0]
            finite = True
            for j in range(width):  # no early exit: the loop stays vectorized
                finite &= abs(row[j]) < np.inf  # False for NaN too
            top = largest(row)
            if not finite:  # as torch's maximum: NaN if the row holds one, else infinity
                top = np.float32(np.inf)
                for j in range(width):
                    if row[j] != row[j]:
                        top = row[j]
                for j in range(width):
                    codes[j] = np.uint8(offset & 255)
                return top
            if top < np.float32(1e-12):
                top = np.float32(1e-12)
            # as the torch ops compute it, (1 / peak) * steps in float32: a row rounds the same on either path
            inv = (np.float32(1.0) / top) * np.float32(steps)
            for j in range(width):
                codes[j] = np.uint8((np.int32(np.rint(row[j] * inv)) + offset) & 255)
            return top
        return impl

    return numba




@functools.cache
def kernel():
    """The compiled `round_rows(rows, steps, offset, hadamard, codes, peak)`, or None (torch ops serve then)."""
    numba = register()
    if numba is None:
        return None

    def round_rows(rows, steps, offset, hadamard, codes, peak):  # pragma: no cover - compiled
        """rows float32 [M, K] -> codes uint8 [M, K], peak [M, 1] (`round_row`, row by row).

        With `hadamard` [BLOCK, BLOCK] (not [0, 0]), each run of BLOCK channels of a row is first
        multiplied by it (`formats.rotate_blocks`): products summed in channel order, which is how the
        GEMM there sums (its bits, tested), with no torch call of its own."""
        count, width = rows.shape
        rotated = np.empty((count, width) if hadamard.shape[0] else (0, 0), np.float32)
        if hadamard.shape[0]:
            rotate(rows, hadamard, rotated)
        for i in range(count):
            peak[i, 0] = round_row(rotated[i] if hadamard.shape[0] else rows[i], steps, offset, codes[i])

    try:
        compiled = compile_kernel(numba, round_rows)
        rows = np.array([[0.5, -1.0], [0.0, 0.0]], np.float32)
        codes, peak = np.empty((2, 2), np.uint8), np.empty((2, 1), np.float32)
        compiled(rows, 127.0, 0, NO_ROTATION, codes, peak)
        if codes[0].tolist() != [64, 129] or peak[:, 0].tolist() != [1.0, np.float32(1e-12)]:
            raise RuntimeError(f"the compiled kernel rounded {rows.tolist()} to {codes.tolist()}, {peak.tolist()}")
    except Exception as exc:  # a compiler error on this platform: never fatal, only slower
        log.warning("int8 row rounding kernel unavailable (%s): torch ops round activations", exc)
        return None
    return compiled
