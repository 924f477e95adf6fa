"""One decoder for every supported family; `FamilyFlags` switch the few places they differ.

Called by `runtime.model_runner`, which owns the `KVArena` and builds a `ForwardContext` per call.
Weights arrive already fused (`qkv`, `gate_up`) from `models.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.models.config import ModelConfig
from flashx_batch.models.layers import GatedMLP, RMSNorm, RotaryTable, apply_rotary
from flashx_batch.runtime.kv import KVArena


@dataclass
class ForwardContext:
    """Per-call metadata shared by all layers.

    prefill: rows are right-padded to T; row i writes stripe i, positions 0..T-1. Causal attention
      means a real token never sees the padding that follows it.
    decode: one token per row at `positions[i]`; keys 0..kv_len-1 are read, `attn_mask` hides the
      slots beyond each row's own length.
    """

    is_prefill: bool
    cos: torch.Tensor  # [B, T, 1, rotary_dim]
    sin: torch.Tensor
    positions: torch.Tensor  # decode: [B]; prefill: unused
    kv_len: int = 0
    attn_mask: torch.Tensor | None = None  # decode: [B, 1, 1, kv_len] bool


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.scale = cfg.head_dim**-0.5
        self.interleaved = cfg.rope.interleaved
        self.qkv = _param((sum(self.split), cfg.hidden_size), dtype, device)
        self.qkv_bias = _param((sum(self.split),), dtype, device) if cfg.attention_bias else None
        self.o_proj = _param((cfg.hidden_size, cfg.q_size), dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.flags.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.flags.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, arena: KVArena) -> torch.Tensor:
        batch, seq = x.shape[:2]
        q, k, v = F.linear(x, self.qkv, self.qkv_bias).split(self.split, dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim)  # [B, T, H, D]
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, ctx.cos, ctx.sin, self.interleaved)
        k = apply_rotary(k, ctx.cos, ctx.sin, self.interleaved)
        k_cache, v_cache = arena.stripes(self.layer)  # [max_rows, cap, Hkv, D]
        if ctx.is_prefill:
            k_cache[:batch, :seq] = k
            v_cache[:batch, :seq] = v
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, scale=self.scale, enable_gqa=True,
            )
        else:
            rows = torch.arange(batch, device=x.device)
            k_cache[rows, ctx.positions] = k[:, 0]
            v_cache[rows, ctx.positions] = v[:, 0]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k_cache[:batch, : ctx.kv_len].transpose(1, 2),
                v_cache[:batch, : ctx.kv_len].transpose(1, 2),
                attn_mask=ctx.attn_mask, scale=self.scale, enable_gqa=True,
            )
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return F.linear(out, self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.attn = Attention(cfg, layer, dtype, device)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        sandwich = cfg.flags.sandwich_norm
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps, dtype, device) if sandwich else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps, dtype, device) if sandwich else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, arena: KVArena) -> torch.Tensor:
        h = self.attn(self.input_norm(x), ctx, arena)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = cfg
        self.embed = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param((cfg.vocab_size, cfg.hidden_size),
                                                                         dtype, device)
        self.rotary: RotaryTable | None = None

    def build_rotary(self, max_positions: int) -> None:
        cfg = self.config
        self.rotary = RotaryTable(cfg.rope, cfg.rotary_dim, max_positions, self.embed.dtype, self.embed.device)

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext, arena: KVArena) -> torch.Tensor:
        """input_ids [B, T] -> final-norm hidden states [B, T, hidden]."""
        x = F.embedding(input_ids, self.embed)
        for layer in self.layers:
            x = layer(x, ctx, arena)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits [..., vocab]."""
        return F.linear(hidden, self.lm_head).float()
