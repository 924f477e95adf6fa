"""A CPU decode step of an all-int8 model in a few calls per layer instead of some sixty.

With every linear layer in `int8_dynamic` (int8 weights, each activation row rounded to int8 as it
goes in: `quant.formats.quantize_rows`), a decode step of a few rows costs far more in dispatch than in
arithmetic: a layer is some sixty small torch ops (norms, RoPE, cache writes, the GEMMs' epilogues,
SwiGLU), each a few microseconds of fixed cost whatever the rows. Here a layer is its four int8 GEMMs
(the same oneDNN calls `QuantLinear` makes) with one compiled pass between each pair, doing everything
elementwise that lies between them:

    norm + round -> qkv GEMM -> scales, RoPE, K / V into the cache -> attention (`cpu_decode`'s kernel)
    -> round -> o GEMM -> scales, residual, norm, round -> gate_up GEMM -> scales -> torch's silu and
    product -> round -> down GEMM -> scales, residual, and the next layer's norm + round (the last: the
    final norm).

The numbers are the modules' own, bit for bit: the same GEMMs on the same codes, each GEMM's scales
applied in its order, the same rounding (`quant.row_kernel.round_row`), RoPE, attention kernel and
silu, and the norm's mean of squares summed in the order torch's CPU sum kernel sums a row (its
vector width found once by reproducing torch's sums on probe rows: `_sum_lanes`; where no width we
know reproduces them, no fused step). So fusing changes no token, only the time (tested step by step).

`Int8Decode.build` takes a model only where this covers it exactly; anything else (a float or mixed
layer, biases, q / k norms, sliding windows, sandwich norms, experts, latent attention, tensor
parallel ranks, a bfloat16 cache, interleaved RoPE, numba missing) gets None and runs the modules as
before. It serves steps of at most `MAX_ROWS` rows reading the cache in extents of their own or through a
paged batch's slot tables (`Reads`); larger steps are not dominated by dispatch and keep torch's
threaded ops. One runner thread at a time: its buffers are the step's own, shared across calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flashx_batch.backends import cpu_decode, on_host
from flashx_batch.models.layers import GatedMLP, RMSNorm
from flashx_batch.quant import formats as fm
from flashx_batch.quant import row_kernel
from flashx_batch.quant.int8_kernels import _NO_PEAK, Kernels, compiled_kernels
from flashx_batch.quant.linear import INT_MM_MAX_ROWS, QuantLinear

log = logging.getLogger("flashx_batch.quant.int8_decode")

MAX_ROWS = fm.PAD_ROWS  # rows a fused step serves: below the prepacked kernel's padding


class _Gemm:
    """One role's int8 linear layers (qkv, o, gate_up or down: the same shape in every layer) with one of
    `QuantLinear`'s two int8_dynamic kernels, and what it reads and writes for up to MAX_ROWS rows: the
    codes (the rounding's grid and zero point are that kernel's), the rows' peaks, the int32 sums."""

    def __init__(self, module: QuantLinear, int_mm: bool) -> None:
        self.int_mm = int_mm  # `torch._int_mm` on the plain weight, else oneDNN's prepacked int8 linear
        packed = module._packed
        self.steps, self.offset = (float(fm.INT_MM_STEPS), 0) if int_mm else (float(packed.steps), int(packed.zero))
        self.hadamard = fm._hadamard_numpy(fm.ROTATION_BLOCK) if module.rotated else row_kernel.NO_ROTATION
        self.codes = torch.empty(MAX_ROWS, module.in_features, dtype=torch.int8)
        self.peak = np.empty((MAX_ROWS, 1), np.float32)
        self.acc = torch.empty(MAX_ROWS, module.out_features, dtype=torch.int32) if int_mm else None
        # one input row before it is rounded, and rotated where the layer is (C-contiguous: they vectorize)
        self.scratch = np.empty((1, module.in_features), np.float32)
        self.rotated = np.empty((1, module.in_features if module.rotated else 0), np.float32)


class _GemmRows:
    """A `_Gemm`'s buffers cut to one step's rows (leading rows: still C-contiguous)."""

    def __init__(self, gemm: _Gemm, rows: int) -> None:
        self.int_mm, self.steps, self.offset, self.hadamard = gemm.int_mm, gemm.steps, gemm.offset, gemm.hadamard
        self.scratch, self.rotated = gemm.scratch, gemm.rotated
        self.codes = gemm.codes[:rows]
        self.codes_np = self.codes.view(torch.uint8).numpy()
        self.peak = gemm.peak[:rows]
        self.acc = None if gemm.acc is None else gemm.acc[:rows]
        self.acc_np = None if self.acc is None else self.acc.numpy()

    def run(self, module: QuantLinear) -> np.ndarray:
        """`module`'s GEMM over the codes -> its raw output (int32 sums, or float32 without the rows' peaks)."""
        if self.int_mm:
            torch._int_mm(self.codes, module.qweight_t, out=self.acc)
            return self.acc_np
        p = module._packed
        out = torch.ops.onednn.qlinear_pointwise(self.codes.view(torch.uint8), 1.0 / p.steps, p.zero, p.packed,
                                                 p.scales, p.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        return np.ascontiguousarray(out.numpy())  # a strided result would compile the kernels anew


class _Buffers:
    """Everything a step writes, made once for MAX_ROWS rows: the GEMMs' for each kernel they may take."""

    def __init__(self, model) -> None:
        cfg = model.config
        attn, mlp = model.layers[0].attn, model.layers[0].mlp
        self.modules = (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down)  # every layer's have these shapes
        self._gemms: dict[tuple[int, bool], _Gemm] = {}
        self.qkv_row = np.empty((1, attn.qkv.out_features), np.float32)
        self.gate_up_out = torch.empty(MAX_ROWS, 2 * cfg.intermediate_size, dtype=torch.float32)
        self.product = torch.empty(MAX_ROWS, cfg.intermediate_size, dtype=torch.float32)
        self.query = np.empty((MAX_ROWS, cfg.num_heads * cfg.head_dim), np.float32)
        self.attended = np.empty_like(self.query)
        self.hidden = torch.empty(MAX_ROWS, cfg.hidden_size, dtype=torch.float32)
        self.no_codes = np.empty((0, cfg.hidden_size), np.uint8)
        self.heads = (cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)

    def gemm(self, role: int, rows: int) -> _Gemm:
        """The buffers of role `role` (qkv, o, gate_up, down) for the kernel a call of `rows` rows takes."""
        module = self.modules[role]
        key = (role, _takes_int_mm(module, rows))
        if key not in self._gemms:
            self._gemms[key] = _Gemm(module, key[1])
        return self._gemms[key]


def _takes_int_mm(module: QuantLinear, rows: int) -> bool:
    """Whether `QuantLinear.forward` multiplies `rows` rows through `torch._int_mm` (else the prepacked kernel)."""
    return module.qweight_t is not None and (module._packed is None or rows <= INT_MM_MAX_ROWS)


class _Step:
    """The views of `_Buffers` one step of `rows` rows uses (made once per row count; views, no memory)."""

    def __init__(self, b: _Buffers, rows: int) -> None:
        self.qkv, self.o, self.gate_up, self.down = (_GemmRows(b.gemm(role, rows), rows) for role in range(4))
        self.qkv_row = b.qkv_row
        inter = b.product.shape[1]
        self.gate_up_out = b.gate_up_out[:rows]
        self.gate_up_np = self.gate_up_out.numpy()
        self.gate, self.up = self.gate_up_out.split(inter, dim=1)
        self.product = b.product[:rows]
        self.product_np = self.product.numpy()
        self.query = b.query[:rows]
        self.query_heads = self.query.reshape(rows, *b.heads)
        self.attended = b.attended[:rows]
        self.attended_heads = self.attended.reshape(rows, *b.heads)
        self.hidden = b.hidden[:rows]
        self.hidden_np = self.hidden.numpy()
        self.no_codes = b.no_codes


def config_why_not(cfg) -> str | None:
    """Why the fused step cannot serve any model of config `cfg` (None: a loaded model may still fail
    `_why_not`); the capabilities record's `fused_int8_decode` row reads it."""
    if cfg.sliding_window is not None and any(cfg.window_layers):
        return "sliding-window layers"
    if cfg.rope.interleaved:
        return "interleaved RoPE"
    if cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim:
        return f"a rotary width of {cfg.rotary_dim} for heads of {cfg.head_dim}"
    if cfg.num_heads % cfg.num_kv_heads:
        return "query heads not a multiple of the KV heads"
    return None


def _why_not(model, caches) -> str | None:
    """Why the fused step cannot serve this model exactly (None: it can): the config's reasons, then the
    loaded modules' and caches' (checked here too, so no caller builds a step that is not exact)."""
    from flashx_batch.models.decoder import Attention  # the decoder imports this module's users

    cfg = model.config
    if model.shard is not None:
        return "a tensor-parallel rank"
    if model.embed.dtype != torch.float32 or not on_host(model.embed):
        return "not a float32 model on the CPU"
    if (reason := config_why_not(cfg)) is not None:
        return reason
    ref = model.layers[0]
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        if not isinstance(attn, Attention) or attn.q_norm is not None:
            return "attention other than plain grouped-query attention"
        if layer.post_attn_norm is not None or layer.post_mlp_norm is not None:
            return "sandwich norms"
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale) != (
                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ref.attn.scale):
            return "layers of different attention shapes"
        if not isinstance(mlp, GatedMLP) or not all(isinstance(n, RMSNorm) for n in (layer.input_norm, layer.mlp_norm)):
            return "an MLP other than a gated one"
        for lin in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down):
            if not isinstance(lin, QuantLinear) or lin.kernel != "int8_dynamic" or lin.bias is not None:
                return "a layer not in int8_dynamic"
            if lin.scales.dtype != torch.float32:
                return "scales not in float32"
        if attn.qkv.out_features != (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim:
            return "a qkv projection of another width"
        if any(getattr(layer.attn, n).rotated != getattr(ref.attn, n).rotated for n in ("qkv", "o_proj")) or any(
                getattr(layer.mlp, n).rotated != getattr(ref.mlp, n).rotated for n in ("gate_up", "down")):
            return "layers rotated differently"
        if any(getattr(layer.mlp, n).in_features != getattr(ref.mlp, n).in_features for n in ("gate_up", "down")):
            return "layers of different MLP widths"
    for keys, values in caches:
        if keys.dtype != torch.float32 or not all(cpu_decode.usable_paged(keys, values, how)
                                                  for how in ("extents", "pages")):  # the step reads both ways
            return "a cache other than a contiguous float32 one"
        if tuple(keys.shape[1:]) != (cfg.num_kv_heads, cfg.head_dim):
            return "a cache of another head shape"
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
        its slots 0..positions[i] (the rest of its table masked, as `ForwardPasses.paged` masks them)."""
        index = table.to(torch.int64).contiguous().numpy()
        if index.size and index.min() < 0:
            raise ValueError("a slot table reaches before the cache")
        pos = positions.to(torch.int64).numpy()
        span = np.arange(index.shape[1])
        bias = np.where(span[None, :] <= pos[:, None], np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
        return cls(index, index.shape[1], cpu_decode._NO_LENGTHS, bias, int(index.max(initial=-1)) + 1)


class Int8Decode:
    """The fused decode step of one model over one arena (`build`); `hidden` runs a step."""

    def __init__(self, model, caches, kernels: Kernels) -> None:
        self.model = model
        self.kernels = kernels
        self.caches = [(k.numpy(), v.numpy()) for k, v in caches]
        self.norms = [(layer.input_norm.weight.numpy(), layer.mlp_norm.weight.numpy()) for layer in model.layers]
        self.final_norm = model.norm.weight.numpy()
        self.eps = np.float32(model.config.rms_norm_eps)
        self.inv = fm._INV_STEPS.numpy()[()]  # the input step `int8_dynamic_matmul` multiplies by
        self.heads = (model.config.num_heads, model.config.num_kv_heads)
        # per layer, per role (qkv, o, gate_up, down): the module and its weight rows' scales
        self.linears = [tuple((lin, lin.scales.contiguous().numpy()) for lin in
                              (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down))
                        for layer in model.layers]
        self.scale = np.float32(model.layers[0].attn.scale)
        self._buffers: _Buffers | None = None  # made at the first step (inside its inference mode)
        self._steps: dict[int, _Step] = {}

    @staticmethod
    def fingerprint(model, caches) -> tuple:
        """What a step is built over: the linear modules themselves (held, so a swapped one never reads as
        the old one) and the cache's memory; anything else means building anew."""
        modules = tuple(getattr(part, name, None) for layer in model.layers
                        for part, name in ((layer.attn, "qkv"), (layer.attn, "o_proj"), (layer.mlp, "gate_up"),
                                           (layer.mlp, "down")))
        return modules, tuple(view[0].data_ptr() for view in caches)

    @classmethod
    def build(cls, model, caches) -> Int8Decode | None:
        """The fused step for `model` writing `caches` (its layers' (keys, values) [slots, Hkv, D]), or None
        where it does not serve this model exactly (`_why_not`) or numba cannot compile it."""
        reason = _why_not(model, caches)
        if reason is not None:
            log.debug("fused int8 decode not used: %s", reason)
            return None
        kernels = compiled_kernels()
        return None if kernels is None else cls(model, caches, kernels)

    @torch.inference_mode()
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
        cos, sin = rotary.cos.contiguous().numpy(), rotary.signed_sin.contiguous().numpy()
        if self._buffers is None:
            self._buffers = _Buffers(self.model)
        b = self._steps.get(count)
        if b is None:
            b = self._steps[count] = _Step(self._buffers, count)
        k, inv, eps, lanes = self.kernels, self.inv, self.eps, self.kernels.lanes
        x = F.embedding(tokens, self.model.embed)  # [B, hidden], fresh: the residual stream, updated in place
        xs = x.numpy()
        qkv, o, gate_up, down = b.qkv, b.o, b.gate_up, b.down
        round_rows, (heads, kv_heads) = row_kernel.kernel(), self.heads
        k.norm_round(xs, self.norms[0][0], eps, lanes, qkv.hadamard, qkv.steps, qkv.offset, qkv.scratch, qkv.rotated,
                     qkv.codes_np, qkv.peak)
        last = len(self.linears) - 1
        for i, ((qkv_w, qkv_s), (o_w, o_s), (gu_w, gu_s), (down_w, down_s)) in enumerate(self.linears):
            keys, values = self.caches[i]
            k.rope_write(qkv.run(qkv_w), inv, qkv_s, qkv.peak, cos, sin, pos, heads, kv_heads, keys, values, write,
                         b.qkv_row, b.query)
            cpu_decode.attend_into(b.query_heads, keys, values, reads.table, reads.slots, reads.lengths, reads.bias,
                                   self.scale, b.attended_heads)
            round_rows(b.attended, o.steps, o.offset, o.hadamard, o.codes_np, o.peak)
            k.residual_norm_round(o.run(o_w), inv, o_s, o.peak, xs, self.norms[i][1], eps, lanes, gate_up.hadamard,
                                  gate_up.steps, gate_up.offset, gate_up.scratch, gate_up.rotated, gate_up.codes_np,
                                  gate_up.peak)
            k.dequant_rows(gate_up.run(gu_w), inv, gu_s, gate_up.peak, b.gate_up_np)
            torch.mul(F.silu(b.gate, inplace=True), b.up, out=b.product)  # `GatedMLP`'s ops: its bits
            round_rows(b.product_np, down.steps, down.offset, down.hadamard, down.codes_np, down.peak)
            acc = down.run(down_w)
            if i < last:
                k.residual_norm_round(acc, inv, down_s, down.peak, xs, self.norms[i + 1][0], eps, lanes, qkv.hadamard,
                                      qkv.steps, qkv.offset, qkv.scratch, qkv.rotated, qkv.codes_np, qkv.peak)
            else:  # no codes: the final norm's rows into the hidden states
                k.residual_norm_round(acc, inv, down_s, down.peak, xs, self.final_norm, eps, lanes,
                                      row_kernel.NO_ROTATION, 0.0, 0, b.hidden_np, qkv.rotated, b.no_codes, _NO_PEAK)
        return b.hidden.clone()  # the buffer is the next step's
