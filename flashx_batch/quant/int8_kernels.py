"""The compiled passes of the fused int8 decode step (`quant.int8_decode`): numba kernels for the norm
and rounding, the residual, RoPE with the cache write, and the GEMMs' epilogues, built once per
process (`compiled_kernels`, cached on disk by numba) and checked against torch before use — the
norm's mean of squares summed in the order torch's CPU sum kernel sums a row (`_sum_lanes`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from dataclasses import dataclass

import numpy as np
import torch

from flashx_batch.backends import cpu_decode
from flashx_batch.quant import row_kernel

log = logging.getLogger("flashx_batch.quant.int8_decode")
_NO_PEAK = np.empty((0, 1), np.float32)  # the final norm's call: it rounds nothing
_LANES = (8, 16, 4)  # vector widths (float32 lanes) torch's CPU sum kernel may reduce with, most likely first


def dequant(acc, inv, scales, peak, i, n):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


def sum_squares(x, lanes):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


def normed(x, weight, eps, lanes, out):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


def finish(rows, hadamard, rotated, steps, offset, codes):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@dataclass(frozen=True)
class Kernels:
    norm_round: object
    residual_norm_round: object
    rope_write: object
    dequant_rows: object
    lanes: int  # the vector width torch's sum kernel reduces a row with on this machine (`_sum_lanes`)


@functools.cache
def compiled_kernels() -> Kernels | None:
    """The compiled passes, or None where numba is missing or fails, or torch's row sums cannot be
    reproduced here (the modules serve every step then)."""
    numba = row_kernel.register()
    if numba is None or cpu_decode._kernel() is None or row_kernel.kernel() is None:
        return None
    from numba.extending import overload

    # the kernels inline row_kernel's overloads, but numba's disk cache only watches this file: the
    # stamp, a closure variable of each kernel, is part of its cache key, so an edited row_kernel misses
    stamp = int(hashlib.sha256(inspect.getsource(row_kernel).encode()).hexdigest()[:12], 16)

    @overload(dequant)
    def _dequant(acc, inv, scales, peak, i, n):
        """Output (i, n) of a GEMM in float32, as `QuantLinear` finishes it: `torch._int_mm`'s int32 sum
        times the input step, the weight row's scale, the row's peak, in that order; the prepacked kernel's
        float output (its scales already applied) times the row's peak."""
        if isinstance(acc.dtype, numba.types.Integer):
            return lambda acc, inv, scales, peak, i, n: ((np.float32(acc[i, n]) * inv) * scales[n]) * peak[i, 0]
        return lambda acc, inv, scales, peak, i, n: acc[i, n] * peak[i, 0]

    @overload(sum_squares)
    def _sum_squares(x, lanes):
        """sum(x * x) of a contiguous float32 row in the order torch's CPU sum kernel adds it (`cascade_sum`:
        vectors of `lanes`, four accumulated side by side in a cascade of levels every 16 steps, then the
        leftover vectors, the four folded, the leftover values, the lanes one after another)."""
        def impl(x, lanes):
            width = x.shape[0]
            vectors = width // lanes
            rows = vectors // 4
            acc = np.zeros((4, 4, lanes), np.float32)  # [level, column, lane]
            blocks = rows // 16 * 16  # rows in whole blocks of 16: each block's end cascades up the levels
            for i in range(rows):
                for k in range(4):
                    base = (4 * i + k) * lanes
                    for lane in range(lanes):
                        acc[0, k, lane] += x[base + lane] * x[base + lane]
                done = i + 1
                if done > blocks or done % 16:
                    continue
                for level in range(1, 4):
                    for k in range(4):
                        for lane in range(lanes):
                            acc[level, k, lane] += acc[level - 1, k, lane]
                            acc[level - 1, k, lane] = 0
                    if done & (15 << (4 * level)):
                        break
            for level in range(1, 4):
                for k in range(4):
                    for lane in range(lanes):
                        acc[0, k, lane] += acc[level, k, lane]
            for vector in range(rows * 4, vectors):
                for lane in range(lanes):
                    acc[0, 0, lane] += x[vector * lanes + lane] * x[vector * lanes + lane]
            for k in range(1, 4):
                for lane in range(lanes):
                    acc[0, 0, lane] += acc[0, k, lane]
            total = np.float32(0.0)
            for j in range(vectors * lanes, width):
                total += x[j] * x[j]
            for lane in range(lanes):
                total += acc[0, 0, lane]
            return total
        return impl

    @overload(normed)
    def _normed(x, weight, eps, lanes, out):
        """out = RMSNorm(x) [K] as `layers.RMSNorm` computes it in float32: x * rsqrt(mean(x^2) + eps) * w."""
        def impl(x, weight, eps, lanes, out):
            scale = np.float32(1.0) / np.sqrt(sum_squares(x, lanes) / np.float32(x.shape[0]) + eps)
            for j in range(x.shape[0]):
                out[j] = (x[j] * scale) * weight[j]
        return impl

    @overload(finish)
    def _finish(rows, hadamard, rotated, steps, offset, codes):
        """rows [1, K] (a linear layer's input) rotated where the layer is (`formats.rotate_blocks`),
        then rounded into codes [K]; returns the peak."""
        def impl(rows, hadamard, rotated, steps, offset, codes):
            if hadamard.shape[0]:
                row_kernel.rotate(rows, hadamard, rotated)
                return row_kernel.round_row(rotated[0], steps, offset, codes)
            return row_kernel.round_row(rows[0], steps, offset, codes)
        return impl

    def norm_round(x, weight, eps, lanes, hadamard, steps, offset, scratch, rotated, codes,
                   peak):  # pragma: no cover - compiled
        """Each row of x [M, K]: normed (`normed`), then rounded for the next GEMM into codes, peak."""
        if stamp < 0:
            return
        for i in range(x.shape[0]):
            normed(x[i], weight, eps, lanes, scratch[0])
            peak[i, 0] = finish(scratch, hadamard, rotated, steps, offset, codes[i])

    def residual_norm_round(acc, inv, scales, acc_peak, x, weight, eps, lanes, hadamard, steps, offset, scratch,
                            rotated, codes, peak):  # pragma: no cover - compiled
        """x [M, K] += the GEMM's output (the residual), then each row normed and rounded (`norm_round`);
        with `codes` of no rows, the normed rows go to `scratch` [M, K] instead (the final norm)."""
        if stamp < 0:
            return
        for i in range(x.shape[0]):
            for n in range(x.shape[1]):
                x[i, n] = dequant(acc, inv, scales, acc_peak, i, n) + x[i, n]
            if codes.shape[0] == 0:
                normed(x[i], weight, eps, lanes, scratch[i])
            else:
                normed(x[i], weight, eps, lanes, scratch[0])
                peak[i, 0] = finish(scratch, hadamard, rotated, steps, offset, codes[i])

    def rope_write(acc, inv, scales, acc_peak, cos, sin, positions, heads, kv_heads, keys, values, write,
                   scratch, query):  # pragma: no cover - compiled
        """The qkv GEMM's output [M, (H + 2 Hkv) D] -> post-RoPE queries into query [M, H D], post-RoPE keys
        and the values into the cache's slot write[i] ([slots, Hkv, D] each). RoPE as `layers.apply_rotary_`:
        x * cos + swap_halves(x) * signed_sin over the first `cos.shape[1]` channels of each head."""
        if stamp < 0:
            return
        dim = keys.shape[2]
        span = cos.shape[1]
        half = span // 2
        for i in range(acc.shape[0]):
            row = scratch[0]
            for n in range(acc.shape[1]):
                row[n] = dequant(acc, inv, scales, acc_peak, i, n)
            p, slot = positions[i], write[i]
            for h in range(heads + kv_heads):
                base = h * dim
                for j in range(dim):
                    v = row[base + j]
                    if j < span:
                        partner = j + half if j < half else j - half
                        v = v * cos[p, j] + row[base + partner] * sin[p, j]
                    if h < heads:
                        query[i, base + j] = v
                    else:
                        keys[slot, h - heads, j] = v
            base = (heads + kv_heads) * dim
            for h in range(kv_heads):
                for j in range(dim):
                    values[slot, h, j] = row[base + h * dim + j]

    def dequant_rows(acc, inv, scales, acc_peak, out):  # pragma: no cover - compiled
        """The GEMM's output [M, N] in float32 into out (SwiGLU's input: torch's vectorized silu takes it
        from there, whose exp numba would call one value at a time)."""
        if stamp < 0:
            return
        for i in range(acc.shape[0]):
            for n in range(acc.shape[1]):
                out[i, n] = dequant(acc, inv, scales, acc_peak, i, n)

    def sum_rows(x, lanes, out):  # pragma: no cover - compiled
        """mean(x * x) of each row, as `normed` computes it (the probe `_sum_lanes` compares with torch)."""
        if stamp < 0:
            return
        for i in range(x.shape[0]):
            out[i] = sum_squares(x[i], lanes) / np.float32(x.shape[1])

    try:
        compiled = {fn.__name__: cpu_decode.compile_kernel(numba, fn)
                    for fn in (norm_round, residual_norm_round, rope_write, dequant_rows, sum_rows)}
        lanes = _sum_lanes(compiled.pop("sum_rows"))
        if lanes is None:
            log.warning("torch's CPU row sums follow no order the fused int8 decode reproduces: decode steps "
                        "run layer by layer")
            return None
        kernels = Kernels(**compiled, lanes=lanes)
        _warm_up(kernels)
    except Exception as exc:  # a compiler error on this platform: never fatal, only slower
        log.warning("fused int8 decode unavailable (%s): decode steps run layer by layer", exc)
        return None
    return kernels


def _sum_lanes(sum_rows) -> int | None:
    """The vector width with which `sum_rows` gives torch's own mean of squares, bit for bit, on random rows
    of widths that take every branch of torch's summation (leftover vectors and values, cascade levels);
    None if no width in `_LANES` does."""
    rng = np.random.default_rng(0)
    probes = [(rng.standard_normal((3, width)) * scale).astype(np.float32)
              for width, scale in ((16, 1.0), (100, 3.0), (256, 0.5), (704, 10.0), (1408, 1.0), (5000, 2.0),
                                   (11008, 1.0), (70000, 0.1))]
    for lanes in _LANES:
        same = True
        for x in probes:
            t = torch.from_numpy(x)
            out = np.empty(len(x), np.float32)
            sum_rows(x, lanes, out)
            same = same and np.array_equal(torch.mean(t * t, -1).numpy(), out)
        if same:
            return lanes
    return None


def _warm_up(k: Kernels) -> None:
    """Each kernel called once with every argument type a step passes (both GEMMs' outputs), so it is
    compiled (or loaded from the disk cache) now and a compiler error surfaces here, not in a step; and
    one known answer checked."""
    f32 = np.float32
    x, weight, scratch = np.ones((1, 4), f32), np.ones(4, f32), np.empty((1, 4), f32)
    codes, peak = np.empty((1, 4), np.uint8), np.empty((1, 1), f32)
    k.norm_round(x, weight, f32(0.0), k.lanes, row_kernel.NO_ROTATION, 127.0, 0, scratch, np.empty((1, 0), f32),
                 codes, peak)
    if codes.tolist() != [[127] * 4] or peak[0, 0] != 1.0:
        raise RuntimeError(f"the compiled norm rounded ones to {codes.tolist()}, peak {peak.tolist()}")
    for acc in (np.ones((1, 4), np.int32), np.ones((1, 4), f32)):
        k.residual_norm_round(acc, f32(1.0), weight, peak, x.copy(), weight, f32(0.0), k.lanes, row_kernel.NO_ROTATION,
                              127.0, 0, scratch, np.empty((1, 0), f32), codes, peak.copy())
        k.residual_norm_round(acc, f32(1.0), weight, peak, x.copy(), weight, f32(0.0), k.lanes, row_kernel.NO_ROTATION,
                              0.0, 0, scratch, np.empty((1, 0), f32), np.empty((0, 4), np.uint8), _NO_PEAK)
        k.dequant_rows(acc, f32(1.0), weight, peak, scratch)
        cache = np.zeros((1, 1, 1), f32)
        k.rope_write(np.ones((1, 3), acc.dtype), f32(1.0), np.ones(3, f32), peak, np.ones((1, 0), f32),
                     np.ones((1, 0), f32), np.zeros(1, np.int64), 1, 1, cache, cache.copy(), np.zeros(1, np.int64),
                     np.empty((1, 3), f32), np.empty((1, 1), f32))
