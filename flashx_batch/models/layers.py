"""Tensor building blocks shared by every decoder family: RMSNorm, rotary tables, MLP.

Numerics deliberately follow `transformers` op for op (norm in float32, RoPE tables computed from
float32 positions) so that float32 greedy decoding is token-identical to it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends import on_host
from flashx_batch.backends.cpu import onednn_linear, onednn_pack
from flashx_batch.models.config import RopeConfig

if TYPE_CHECKING:
    from flashx_batch.models.lora import LoraLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order of operations (so float32 results are bitwise equal to it), with the
        # temporaries updated in place: on CPU a fresh multi-MB temporary costs page faults, which made
        # the out-of-place form (and F.rms_norm) several times slower on a prefill (docs/architecture.md,
        # "CPU decode path").
        x32 = x.float()
        scale = torch.mean(x32 * x32, -1, keepdim=True).add_(self.eps).rsqrt_()
        if x.dtype == torch.float32:
            return torch.mul(x32, scale).mul_(self.weight)
        return self.weight * torch.mul(x32, scale).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies for `rotary_dim` channels, with `linear` / `llama3` scaling applied."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, rotary_dim, inv_freq)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, rotary_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: channels that turn fewer than `beta_slow` times over the pretrained context are interpolated
    (frequency / factor), those turning more than `beta_fast` times keep theirs, a linear ramp between."""
    def channel(rotations: float) -> float:  # the rotary channel pair that turns `rotations` times
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = channel(rope.beta_fast), channel(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: interpolated
    pos_freqs = rope.theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


class RotaryTable:
    """cos / signed sin for every position up to `max_positions`, built once at load, indexed per step.

    The sin table carries the rotation's sign (see `angles`), so applying RoPE is
    x * cos + swap(x) * signed_sin: a swap of halves (or of pairs) and no negation per call.
    """

    def __init__(self, rope: RopeConfig, rotary_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(rope, rotary_dim)
        self.rotary_dim = rotary_dim
        self.interleaved = rope.interleaved
        self.max_positions = max_positions
        cos, signed_sin = self.angles(torch.arange(max_positions, dtype=torch.int64).float())
        # yarn scales the embedding (not `angles`, which must stay a pure rotation for re-rotating keys)
        if rope.attention_factor != 1.0:
            cos, signed_sin = cos * rope.attention_factor, signed_sin * rope.attention_factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.signed_sin = signed_sin.to(dtype=dtype, device=device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, signed sin [P, rotary_dim] for any (also fractional) positions [P].

        `transformers` computes x * cos + rotate(x) * sin, where rotate negates half of the swapped
        channels (the first half, or the first of each pair); here that sign sits in the sin table
        instead: (-a) * s and a * (-s) are the same float, so results stay bitwise equal."""
        freqs = positions.float().cpu()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        half = self.rotary_dim // 2
        if self.interleaved:
            # GLM pairs adjacent channels: channel 2i and 2i+1 share frequency i.
            cos = cos[:, :half].repeat_interleave(2, dim=-1)
            sin = sin[:, :half].repeat_interleave(2, dim=-1)
            sin[:, 0::2] = -sin[:, 0::2]
        else:
            sin[:, :half] = -sin[:, :half]
        return cos, sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate float32 keys x [..., P, H, D] to `positions` [P] (or back from them, `inverse`)."""
        cos, sin = (t.to(x.device)[:, None, :] for t in self.angles(positions))  # [P, 1, rotary_dim]
        return apply_rotary(x, cos, -sin if inverse else sin, self.interleaved)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, signed sin [B, T, 1, rotary_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(2), self.signed_sin[positions].unsqueeze(2)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def _swap_pairs(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [B, T, H, D]; rotates the first `cos.shape[-1]` channels, passes the rest through (into a
    new tensor: x is left as it is). `signed_sin` as `RotaryTable.angles` makes it."""
    return apply_rotary_(x.clone(), cos, signed_sin, interleaved)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding written into x itself (a projection's fresh output) and returned:
    x * cos + swap(x) * signed_sin, transformers' operations in its order (float32 results bitwise
    equal), with only the swapped copy a new tensor (on a CPU prefill each fresh multi-MB temporary
    costs page faults). The pass-through channels of a partial rotary are simply left alone."""
    x_rot = x[..., : cos.shape[-1]]
    turned = (_swap_pairs if interleaved else _swap_halves)(x_rot).mul_(signed_sin)
    x_rot.mul_(cos).add_(turned)
    return x


class Linear(nn.Module):
    """y = x W^T (+ b). A module, not a bare tensor, so that quantization can swap it at load time
    (gpt-fast style) without the decoder knowing which weight format it runs."""

    cpu_packable = True  # the CPU backend's `prepare_model` calls `pack` where oneDNN takes the weight's dtype
    lora: LoraLinear | None = None  # LoRA adapters stacked onto this linear (`models.lora.LoraSet`)

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None  # CPU: a oneDNN-packed copy of `weight`, see `pack`

    @property
    def pack_dtype(self) -> torch.dtype | None:
        """The dtype `pack` would pack (None off the CPU: nothing to pack there)."""
        return self.weight.dtype if on_host(self.weight) else None

    def pack(self) -> None:
        """Keep a copy of the weight in oneDNN's own blocked layout and multiply through oneDNN's linear
        from now on, for any number of rows (one copy serves decode and prefill).

        On x86 CPUs oneDNN's kernels for a packed weight run a decode step's few-row matmuls two to
        three times as fast as MKL's sgemm (packed for the row count or not), and a prefill's 1.1-1.5x
        (docs/benchmarks.md, "Float32 linears through oneDNN"). The copy is taken now: a later
        change to `weight` is not seen (weights are read-only once loaded). Rounding differs from
        sgemm's in the last bits, as sgemm's own does between row counts."""
        self.packed = onednn_pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = onednn_linear(x, self.packed, self.bias) if self.packed is not None else F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add_(x, y)


# a CPU prefill's gate / up output per chunk (`GatedMLP.forward`): under glibc's 32 MB mmap ceiling, so the
# chunk's buffer is reused from the heap, and large enough that the GEMMs keep their efficiency at two
# threads (docs/benchmarks.md, "Gated MLP in row chunks")
MLP_CHUNK_BYTES = 24 << 20


class GatedMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul at load time."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.gate_up = Linear(2 * intermediate, hidden, False, dtype, device)
        self.down = Linear(hidden, intermediate, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not on_host(x):  # no shape guard for a compiler to record
            return self._rows(x)
        rows = x.numel() // x.shape[-1]
        chunk = self.chunk_rows(x.element_size())
        if rows <= chunk:
            return self._rows(x)
        # a CPU prefill: the [tokens, 2 x intermediate] projection output runs to tens of MB, each call a
        # fresh mapping whose page faults cost more than its GEMM (allocations over glibc's 32 MB mmap
        # ceiling are never reused), and the gate / up passes run from memory instead of cache. In row
        # chunks the intermediate stays small; each row is computed as before, in its chunk (a GEMM may
        # round a row's last bit differently for another row count, as it already does between batches).
        flat = x.reshape(rows, x.shape[-1])
        out = torch.empty(rows, self.hidden, dtype=x.dtype, device=x.device)
        lora = getattr(self.gate_up, "lora", None) or getattr(self.down, "lora", None)  # quantized: none
        run = lora.owner.current if lora is not None else None  # a LoRA pass: each chunk its rows' adapters
        try:
            for a in range(0, rows, chunk):
                if run is not None:
                    run.window = (a, min(a + chunk, rows), rows)
                out[a : a + chunk] = self._rows(flat[a : a + chunk])
        finally:
            if run is not None:
                run.window = None
        return out.view(*x.shape[:-1], -1)

    def chunk_rows(self, itemsize: int) -> int:
        """Rows per chunk of a CPU prefill: the gate / up output at most MLP_CHUNK_BYTES, a multiple of 64."""
        return max(64, MLP_CHUNK_BYTES // (2 * self.intermediate * itemsize) // 64 * 64)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.forward(x).split(self.intermediate, dim=-1)
        # in place on the projection's own output: the same values as silu(gate) * up without two
        # fresh [tokens, intermediate] temporaries (page faults on CPU; docs/architecture.md, "CPU decode path")
        return self.down.forward(F.silu(gate, inplace=True).mul_(up))
