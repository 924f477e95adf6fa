"""A CPU decode step of an all-int8 model in a few calls per layer instead of some sixty.

With every linear layer in `int8_dynamic` (int8 weights, each activation row rounded to int8 as it
goes in: `quant.formats.quantize_rows`), a decode step of a few rows costs far more in dispatch than in
arithmetic: a layer is some sixty small torch ops (norms, RoPE, cache writes, the GEMMs' epilogues,
SwiGLU), each a few microseconds of fixed cost whatever the rows. Here a layer is its four int8 GEMMs
(the same oneDNN calls `QuantLinear` makes) with one compiled pass between each pair, doing everything
elementwise that lies between them:

    norm + round -> qkv GEMM -> scales, RoPE, K / V into the cache -> attention (`cpu_decode`'s kernel)
    -> round -> o GEMM -> scales, residual, norm, round -> gate_up GEMM -> scales, SwiGLU, round
    -> down GEMM -> scales, residual, and the next layer's norm + round (the last: the final norm).

The numbers are the unfused path's: the same GEMMs on the same codes, each GEMM's scales applied in
its order, the same rounding (`quant.row_kernel.round_row`) and RoPE and attention bits. Two steps
sum in another order or call another exp: the norm's mean of squares and SwiGLU's sigmoid, so a value
may differ from the unfused path's in its last bit and, once in a long while, a code by one step
(tests bound the logits' difference).

`Int8Decode.build` takes a model only where this covers it exactly; anything else (a float or mixed
layer, biases, q / k norms, sliding windows, sandwich norms, experts, latent attention, tensor
parallel ranks, a bfloat16 cache, interleaved RoPE, numba missing) gets None and runs the modules as
before. It serves steps of rows in extents of their own (`cpu_decode.RowExtents`) of at most
`MAX_ROWS` rows; larger steps are not dominated by dispatch and keep torch's threaded ops.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flashx_batch.models import cpu_decode
from flashx_batch.models.layers import GatedMLP, RMSNorm
from flashx_batch.quant import formats as fm
from flashx_batch.quant import row_kernel
from flashx_batch.quant.linear import INT_MM_MAX_ROWS, QuantLinear

log = logging.getLogger("flashx_batch.quant.int8_decode")

_NO_PEAK = np.empty((0, 1), np.float32)  # the final norm's call: it rounds nothing

MAX_ROWS = fm.PAD_ROWS  # rows a fused step serves: below the prepacked kernel's padding, one buffer set per count


def dequant(acc, inv, scales, peak, i, n):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


def normed(x, weight, eps, out):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


def finish(rows, hadamard, rotated, steps, offset, codes):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@functools.cache
def _kernels():
    """The compiled passes, or None where numba is missing or fails (the modules serve every step then)."""
    numba = row_kernel.register()
    if numba is None or cpu_decode._kernel() is None:
        return None
    from numba.extending import overload

    @overload(dequant)
    def _dequant(acc, inv, scales, peak, i, n):
        """Output (i, n) of a GEMM in float32, as `QuantLinear` finishes it: `torch._int_mm`'s int32 sum
        times the input step, the weight row's scale, the row's peak, in that order; the prepacked kernel's
        float output (its scales already applied) times the row's peak."""
        if isinstance(acc.dtype, numba.types.Integer):
            return lambda acc, inv, scales, peak, i, n: ((np.float32(acc[i, n]) * inv) * scales[n]) * peak[i, 0]
        return lambda acc, inv, scales, peak, i, n: acc[i, n] * peak[i, 0]

    @overload(normed, jit_options={"fastmath": {"reassoc", "nsz"}})
    def _normed(x, weight, eps, out):
        """out = RMSNorm(x) [K] as `layers.RMSNorm` computes it in float32: x * rsqrt(mean(x^2) + eps) * w
        (the sum of squares vectorized, so in another order than torch's)."""
        def impl(x, weight, eps, out):
            total = np.float32(0.0)
            for j in range(x.shape[0]):
                total += x[j] * x[j]
            scale = np.float32(1.0) / np.sqrt(total / np.float32(x.shape[0]) + eps)
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

    def norm_round(x, weight, eps, hadamard, steps, offset, scratch, rotated, codes, peak):  # pragma: no cover
        """Each row of x [M, K]: normed (`normed`), then rounded for the next GEMM into codes, peak."""
        for i in range(x.shape[0]):
            normed(x[i], weight, eps, scratch[0])
            peak[i, 0] = finish(scratch, hadamard, rotated, steps, offset, codes[i])

    def residual_norm_round(acc, inv, scales, acc_peak, x, weight, eps, hadamard, steps, offset, scratch, rotated,
                            codes, peak):  # pragma: no cover - compiled
        """x [M, K] += the GEMM's output (the residual), then each row normed and rounded (`norm_round`);
        with `codes` of no rows, the normed rows go to `scratch` [M, K] instead (the final norm)."""
        for i in range(x.shape[0]):
            for n in range(x.shape[1]):
                x[i, n] = dequant(acc, inv, scales, acc_peak, i, n) + x[i, n]
            if codes.shape[0] == 0:
                normed(x[i], weight, eps, scratch[i])
            else:
                normed(x[i], weight, eps, scratch[0])
                peak[i, 0] = finish(scratch, hadamard, rotated, steps, offset, codes[i])

    def rope_write(acc, inv, scales, acc_peak, cos, sin, positions, heads, kv_heads, keys, values, write,
                   scratch, query):  # pragma: no cover - compiled
        """The qkv GEMM's output [M, (H + 2 Hkv) D] -> post-RoPE queries into query [M, H D], post-RoPE keys
        and the values into the cache's slot write[i] ([slots, Hkv, D] each). RoPE as `layers.apply_rotary_`:
        x * cos + swap_halves(x) * signed_sin over the first `cos.shape[1]` channels of each head."""
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
        for i in range(acc.shape[0]):
            for n in range(acc.shape[1]):
                out[i, n] = dequant(acc, inv, scales, acc_peak, i, n)

    try:
        compiled = {fn.__name__: row_kernel.compile_kernel(numba, fn)
                    for fn in (norm_round, residual_norm_round, rope_write, dequant_rows)}
        _warm_up(compiled)
    except Exception as exc:  # a compiler error on this platform: never fatal, only slower
        log.warning("fused int8 decode unavailable (%s): decode steps run layer by layer", exc)
        return None
    return compiled


def _warm_up(k: dict) -> None:
    """Each kernel called once with every argument type a step passes (both GEMMs' outputs), so it is
    compiled (or loaded from the disk cache) now and a compiler error surfaces here, not in a step; and
    one known answer checked."""
    f32 = np.float32
    x, weight, scratch = np.ones((1, 4), f32), np.ones(4, f32), np.empty((1, 4), f32)
    codes, peak = np.empty((1, 4), np.uint8), np.empty((1, 1), f32)
    k["norm_round"](x, weight, f32(0.0), row_kernel.NO_ROTATION, 127.0, 0, scratch, np.empty((1, 0), f32), codes,
                    peak)
    if codes.tolist() != [[127] * 4] or peak[0, 0] != 1.0:
        raise RuntimeError(f"the compiled norm rounded ones to {codes.tolist()}, peak {peak.tolist()}")
    for acc in (np.ones((1, 4), np.int32), np.ones((1, 4), f32)):
        k["residual_norm_round"](acc, f32(1.0), weight, peak, x.copy(), weight, f32(0.0), row_kernel.NO_ROTATION, 127.0,
                                 0, scratch, np.empty((1, 0), f32), codes, peak.copy())
        k["residual_norm_round"](acc, f32(1.0), weight, peak, x.copy(), weight, f32(0.0), row_kernel.NO_ROTATION, 0.0,
                                 0, scratch, np.empty((1, 0), f32), np.empty((0, 4), np.uint8), _NO_PEAK)
        k["dequant_rows"](acc, f32(1.0), weight, peak, scratch)
        cache = np.zeros((1, 1, 1), f32)
        k["rope_write"](np.ones((1, 3), acc.dtype), f32(1.0), np.ones(3, f32), peak, np.ones((1, 0), f32),
                        np.ones((1, 0), f32), np.zeros(1, np.int64), 1, 1, cache, cache.copy(), np.zeros(1, np.int64),
                        np.empty((1, 3), f32), np.empty((1, 1), f32))


@dataclass
class _Gemm:
    """One role's int8 linear layers (qkv, o, gate_up or down: the same shape in every layer) as a fused
    step calls them, for one row count: the kernel `QuantLinear.forward` would pick for that many rows,
    the codes it reads (the rounding's grid and zero point are that kernel's), and where its output lands."""

    int_mm: bool  # `torch._int_mm` on the plain weight, else oneDNN's prepacked int8 linear
    steps: float
    offset: int
    hadamard: np.ndarray
    codes: torch.Tensor  # int8 [M, K]
    codes_np: np.ndarray  # the same memory as uint8
    peak: np.ndarray  # float32 [M, 1]
    acc: torch.Tensor | None  # int32 [M, N] (`_int_mm` writes it), None for the prepacked kernel
    scratch: np.ndarray  # float32 [1, K]: one input row before it is rounded (C-contiguous: it vectorizes)
    rotated: np.ndarray  # float32 [1, K] or [1, 0]: that row rotated, where the layer is

    @classmethod
    def build(cls, module: QuantLinear, rows: int) -> _Gemm:
        packed = module._packed
        int_mm = module.qweight_t is not None and (packed is None or rows <= INT_MM_MAX_ROWS)
        steps, offset = (float(fm.INT_MM_STEPS), 0) if int_mm else (float(packed.steps), int(packed.zero))
        codes = torch.empty(rows, module.in_features, dtype=torch.int8)
        acc = torch.empty(rows, module.out_features, dtype=torch.int32) if int_mm else None
        hadamard = fm._hadamard_numpy(fm.ROTATION_BLOCK) if module.rotated else row_kernel.NO_ROTATION
        width = module.in_features
        return cls(int_mm, steps, offset, hadamard, codes, codes.view(torch.uint8).numpy(),
                   np.empty((rows, 1), np.float32), acc, np.empty((1, width), np.float32),
                   np.empty((1, width if module.rotated else 0), np.float32))

    def run(self, module: QuantLinear) -> np.ndarray:
        """`module`'s GEMM over the codes -> its raw output (int32 sums, or float32 without the rows' peaks)."""
        if self.int_mm:
            torch._int_mm(self.codes, module.qweight_t, out=self.acc)
            return self.acc.numpy()
        p = module._packed
        out = torch.ops.onednn.qlinear_pointwise(self.codes.view(torch.uint8), 1.0 / p.steps, p.zero, p.packed,
                                                 p.scales, p.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        return out.numpy()


class _Buffers:
    """Everything a step of `rows` rows writes, made once per row count."""

    def __init__(self, model, rows: int) -> None:
        cfg = model.config
        layer = model.layers[0]
        self.qkv = _Gemm.build(layer.attn.qkv, rows)
        self.o = _Gemm.build(layer.attn.o_proj, rows)
        self.gate_up = _Gemm.build(layer.mlp.gate_up, rows)
        self.down = _Gemm.build(layer.mlp.down, rows)
        self.qkv_row = np.empty((1, layer.attn.qkv.out_features), np.float32)
        self.gate_up_out = torch.empty(rows, 2 * cfg.intermediate_size, dtype=torch.float32)
        self.gate, self.up = self.gate_up_out.split(cfg.intermediate_size, dim=1)
        self.product = torch.empty(rows, cfg.intermediate_size, dtype=torch.float32)
        self.query = np.empty((rows, cfg.num_heads * cfg.head_dim), np.float32)
        group = cfg.num_heads // cfg.num_kv_heads
        self.query_heads = self.query.reshape(rows, cfg.num_kv_heads, group, cfg.head_dim)
        self.attended = np.empty_like(self.query)
        self.attended_heads = self.attended.reshape(self.query_heads.shape)
        self.hidden = torch.empty(rows, cfg.hidden_size, dtype=torch.float32)
        self.no_codes = np.empty((0, cfg.hidden_size), np.uint8)


def _why_not(model, caches) -> str | None:
    """Why the fused step cannot serve this model exactly (None: it can)."""
    from flashx_batch.models.decoder import Attention  # the decoder imports this module's users

    cfg = model.config
    if model.shard is not None:
        return "a tensor-parallel rank"
    if cfg.sliding_window is not None and any(cfg.window_layers):
        return "sliding-window layers"
    if cfg.rope.interleaved or cfg.rotary_dim % 2:
        return "interleaved RoPE"
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        if not isinstance(attn, Attention) or attn.q_norm is not None or layer.post_attn_norm is not None:
            return "attention other than plain grouped-query attention"
        if not isinstance(mlp, GatedMLP) or not all(isinstance(n, RMSNorm) for n in (layer.input_norm, layer.mlp_norm)):
            return "an MLP other than a gated one"
        for lin in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down):
            if not isinstance(lin, QuantLinear) or lin.kernel != "int8_dynamic" or lin.bias is not None:
                return "a layer not in int8_dynamic"
            if lin.scales.dtype != torch.float32:
                return "scales not in float32"
        ref = model.layers[0]
        if any(getattr(layer.attn, n).rotated != getattr(ref.attn, n).rotated for n in ("qkv", "o_proj")) or any(
                getattr(layer.mlp, n).rotated != getattr(ref.mlp, n).rotated for n in ("gate_up", "down")):
            return "layers rotated differently"
    for keys, values in caches:
        if keys.dtype != torch.float32 or not cpu_decode.usable_paged(keys, values):
            return "a cache other than a contiguous float32 one"
    if model.embed.dtype != torch.float32 or model.embed.device.type != "cpu":
        return "not a float32 model on the CPU"
    return None


@dataclass(frozen=True)
class Reads:
    """Which cache slots each row's attention reads, as `cpu_decode`'s kernel takes them: rows in extents of
    their own (`extents`), or through a paged batch's slot table (`paged`)."""

    table: np.ndarray  # int64: each row's first flat slot [B], or its slot table [B, L]
    slots: int  # slots the longest row reads
    lengths: np.ndarray  # int64 [B] each row's slots (extents), or empty
    bias: np.ndarray  # float32 [B, L]: -inf on a paged row's slots past its position, or empty
    end: int  # one past the largest flat slot read

    @classmethod
    def extents(cls, rows: cpu_decode.RowExtents) -> Reads:
        return cls(rows.starts, rows.longest, rows.lengths, cpu_decode._NO_BIAS, rows.end)

    @classmethod
    def paged(cls, table: torch.Tensor, positions: torch.Tensor) -> Reads:
        """table [B, L] flat slot of each row's position (L > every position), positions [B]: row i reads
        its slots 0..positions[i] (the rest of its table masked, as `TorchRunner.paged` masks them)."""
        index = table.to(torch.int64).contiguous().numpy()
        if index.size and index.min() < 0:
            raise ValueError("a slot table reaches before the cache")
        pos = positions.to(torch.int64).numpy()
        span = np.arange(index.shape[1])
        bias = np.where(span[None, :] <= pos[:, None], np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
        return cls(index, index.shape[1], cpu_decode._NO_LENGTHS, bias, int(index.max(initial=-1)) + 1)


class Int8Decode:
    """The fused decode step of one model over one arena (`build`); `hidden` runs a step."""

    def __init__(self, model, caches) -> None:
        self.model = model
        self.kernels = _kernels()
        self.caches = [(k.numpy(), v.numpy()) for k, v in caches]
        self.norms = [(layer.input_norm.weight.numpy(), layer.mlp_norm.weight.numpy()) for layer in model.layers]
        self.final_norm = model.norm.weight.numpy()
        self.eps = np.float32(model.config.rms_norm_eps)
        self.inv = np.float32(1.0 / fm.INT_MM_STEPS)  # `formats._INV_STEPS`
        self.layers = list(model.layers)
        # per layer, per role (qkv, o, gate_up, down): the module and its weight rows' scales
        self.linears = [tuple((lin, lin.scales.contiguous().numpy()) for lin in
                              (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down))
                        for layer in model.layers]
        self.scale = np.float32(model.layers[0].attn.scale)
        self._buffers: dict[int, _Buffers] = {}

    @staticmethod
    def fingerprint(model, caches) -> tuple:
        """What the step was built over: a swapped module (a new precision) or cache means building anew."""
        mods = tuple(id(getattr(part, name, None)) for layer in model.layers
                     for part, name in ((layer.attn, "qkv"), (layer.attn, "o_proj"), (layer.mlp, "gate_up"),
                                        (layer.mlp, "down")))
        return mods, tuple(view[0].data_ptr() for view in caches)

    @classmethod
    def build(cls, model, caches) -> Int8Decode | None:
        """The fused step for `model` writing `caches` (its layers' (keys, values) [slots, Hkv, D]), or None
        where it does not serve this model exactly (`_why_not`) or numba cannot compile it."""
        reason = _why_not(model, caches)
        if reason is not None:
            log.debug("fused int8 decode not used: %s", reason)
            return None
        if _kernels() is None:
            return None
        return cls(model, caches)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, write_flat: torch.Tensor,
               reads: Reads) -> torch.Tensor:
        """One decode step: tokens [B] at RoPE positions [B], row i's new K / V into flat slot write_flat[i],
        attention over `reads` -> final-norm hidden states [B, hidden]."""
        count = len(tokens)
        if not 0 < count <= MAX_ROWS or len(reads.table) != count:
            raise ValueError(f"a fused step serves 1..{MAX_ROWS} rows with one read each, not {count}")
        slots = self.caches[0][0].shape[0]
        pos = positions.to(torch.int64).contiguous().numpy()
        write = write_flat.to(torch.int64).contiguous().numpy()
        # the kernels index without bounds checks
        if reads.end > slots or write.min() < 0 or write.max() >= slots:
            raise ValueError(f"rows reach outside the cache's {slots} slots")
        rotary = self.model.rotary
        if pos.min() < 0 or pos.max() >= rotary.max_positions:
            raise ValueError(f"a position outside the RoPE table's 0..{rotary.max_positions - 1}")
        b = self._buffers.get(count)
        if b is None:
            b = self._buffers[count] = _Buffers(self.model, count)
        k, inv, eps = self.kernels, self.inv, self.eps
        cos, sin = rotary.cos.numpy(), rotary.signed_sin.numpy()
        x = F.embedding(tokens, self.model.embed)  # [B, hidden], fresh: the residual stream, updated in place
        xs = x.numpy()
        attend_numba, attend = cpu_decode._kernel()
        threads = min(torch.get_num_threads(), attend_numba.config.NUMBA_NUM_THREADS)
        attend_numba.set_num_threads(threads)
        parts = cpu_decode.head_parts(count, b.query_heads.shape[1], threads)
        qkv, o, gate_up, down = b.qkv, b.o, b.gate_up, b.down
        round_rows, hidden = row_kernel.kernel(), b.hidden.numpy()
        k["norm_round"](xs, self.norms[0][0], eps, qkv.hadamard, qkv.steps, qkv.offset, qkv.scratch, qkv.rotated,
                        qkv.codes_np, qkv.peak)
        gate_up_out, product = b.gate_up_out.numpy(), b.product.numpy()
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            (qkv_w, qkv_s), (o_w, o_s), (gu_w, gu_s), (down_w, down_s) = self.linears[i]
            keys, values = self.caches[i]
            k["rope_write"](qkv.run(qkv_w), inv, qkv_s, qkv.peak, cos, sin, pos, layer.attn.num_heads,
                            layer.attn.num_kv_heads, keys, values, write, b.qkv_row, b.query)
            attend(b.query_heads, keys, values, reads.table, reads.slots, reads.lengths, reads.bias, self.scale, parts,
                   b.attended_heads)
            round_rows(b.attended, o.steps, o.offset, o.hadamard, o.codes_np, o.peak)
            k["residual_norm_round"](o.run(o_w), inv, o_s, o.peak, xs, self.norms[i][1], eps, gate_up.hadamard,
                                     gate_up.steps, gate_up.offset, gate_up.scratch, gate_up.rotated,
                                     gate_up.codes_np, gate_up.peak)
            k["dequant_rows"](gate_up.run(gu_w), inv, gu_s, gate_up.peak, gate_up_out)
            torch.mul(F.silu(b.gate, inplace=True), b.up, out=b.product)  # `GatedMLP`'s ops: its bits
            round_rows(product, down.steps, down.offset, down.hadamard, down.codes_np, down.peak)
            acc = down.run(down_w)
            if i < last:
                k["residual_norm_round"](acc, inv, down_s, down.peak, xs, self.norms[i + 1][0], eps, qkv.hadamard,
                                         qkv.steps, qkv.offset, qkv.scratch, qkv.rotated, qkv.codes_np, qkv.peak)
            else:  # no codes: the final norm's rows into the hidden states
                k["residual_norm_round"](acc, inv, down_s, down.peak, xs, self.final_norm, eps,
                                         row_kernel.NO_ROTATION, 0.0, 0, hidden, qkv.rotated, b.no_codes, _NO_PEAK)
        return b.hidden.clone()  # the buffer is the next step's
