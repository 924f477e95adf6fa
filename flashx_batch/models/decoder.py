"""One decoder for every supported family; `FamilyFlags` switch the few places they differ.

Called by the torch model runner, which builds one `models.forward` metadata object per call and
hands each layer its cache as plain `(keys, values)` views (never the arena). Weights arrive already
fused (`qkv`, `gate_up`) from `models.loader`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.models import cpu_decode
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.forward import (
    Decode,
    Extend,
    FinalLayerInputs,
    ForwardMeta,
    Packed,
    PackedTrees,
    Paged,
    TeacherForced,
    split_rows,
)
from flashx_batch.models.layers import GatedMLP, Linear, RMSNorm, RotaryTable, apply_rotary_
from flashx_batch.models.mla import IndexerChoice, MLAttention
from flashx_batch.models.moe import SparseMoE
from flashx_batch.models.parallel import TensorShard, rank_config

# one layer's cache: keys and values, [slots, kv_heads, head_dim] each; for latent attention (`models.mla`)
# one [slots, 1, entry] view of its latents
KVView = tuple[torch.Tensor, ...]


def window_band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, n] boolean: query i sees key j when j <= i and j > i - window (a sliding layer's causal band)."""
    i = torch.arange(n, device=device)
    offset = i[:, None] - i[None, :]
    return (offset >= 0) & (offset < window)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 shard: TensorShard | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.shard = shard  # a tensor-parallel rank: `cfg` is its share of the heads (`models.parallel`)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.scale = cfg.head_dim**-0.5
        self.interleaved = cfg.rope.interleaved
        self.qkv = Linear(sum(self.split), cfg.hidden_size, cfg.attention_bias, dtype, device)
        self.o_proj = Linear(cfg.hidden_size, cfg.q_size, False, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.flags.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.flags.qk_norm else None
        # a sliding layer's queries see their last `window` keys (themselves included); None: every earlier key
        self.window = cfg.sliding_window if cfg.window_layers[layer] else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> post-RoPE q [B, T, H, D], k and v [B, T, Hkv, D] (also the ONNX export's)."""
        batch, seq = x.shape[:2]
        qkv = self.qkv.forward(x)
        v = qkv[..., self.split[0] + self.split[1] :].unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is None:
            # q and k sit side by side in the fused projection: rotate them as one [H + Hkv] head
            # tensor (five kernels instead of ten per layer), then split the result.
            qk = qkv[..., : self.split[0] + self.split[1]].unflatten(-1, (self.num_heads + self.num_kv_heads,
                                                                           self.head_dim))
            qk = apply_rotary_(qk, cos, sin, self.interleaved)
            return qk[:, :, : self.num_heads], qk[:, :, self.num_heads :], v
        q, k, _ = qkv.split(self.split, dim=-1)
        q = self.q_norm.forward(q.reshape(batch, seq, self.num_heads, self.head_dim))
        k = self.k_norm.forward(k.reshape(batch, seq, self.num_kv_heads, self.head_dim))
        return apply_rotary_(q, cos, sin, self.interleaved), apply_rotary_(k, cos, sin, self.interleaved), v

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: KVView | None, last_only: bool = False
                ) -> torch.Tensor:
        batch, seq = x.shape[:2]
        q, k, v = self.project(x, meta.cos, meta.sin)
        match meta:
            case Packed() if last_only:
                out = self._packed_last(q, k, v, meta, cache)
                seq = out.shape[2]
            case Extend() if last_only:
                out = self._extend(q, k, v, meta, cache, True)
                seq = out.shape[2]
            case _ if last_only:
                raise ValueError(f"last_only serves packed and extend forwards, not {type(meta).__name__}")
            case TeacherForced() if meta.visible is not None:  # token trees: the mask the caller built
                mask = meta.visible if self.window is None else meta.window_visible
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     attn_mask=mask[:, None], scale=self.scale, enable_gqa=True)
            case TeacherForced():
                out = self._causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            case PackedTrees():
                out = self._packed_trees(q, k, v, meta)
            case Decode():
                out = self._decode(q, k, v, meta, cache)
            case Packed():
                out = self._packed(q, k, v, meta, cache)
            case Paged():
                out = self._paged(q, k, v, meta, cache)
            case Extend():
                out = self._extend(q, k, v, meta, cache)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj.forward(out)

    def _decode(self, q, k, v, ctx: Decode, cache: KVView) -> torch.Tensor:
        k_flat, v_flat = cache
        k_flat.index_copy_(0, ctx.write_flat, k[:, 0])  # row i's new token -> its slot
        v_flat.index_copy_(0, ctx.write_flat, v[:, 0])
        if ctx.row_extents is not None and self.window is None and cpu_decode.usable_paged(k_flat, v_flat):
            # rows in extents: every row read to its own length in one kernel call, not one call per run
            batch, group = q.shape[0], self.num_heads // self.num_kv_heads
            folded = q.reshape(batch, self.num_kv_heads, group, self.head_dim)
            out = cpu_decode.attend_rows(folded, k_flat, v_flat, ctx.row_extents, self.scale)
            return out.reshape(batch, self.num_heads, 1, self.head_dim)
        # each run of rows read in place through its strided view, up to its own longest row
        # (rows of very different lengths split into runs read only as far as each needs)
        outs, mask = [], ctx.attn_mask
        for a, b, kv, masked in ctx.runs:
            keys, values = kv[self.layer]
            if self.window is not None:  # the band every row of the run sees, whatever its length
                run_mask = ctx.window_mask[a:b, ..., : keys.shape[-2]]
            else:
                run_mask = None if masked is None else mask[a:b, ..., :masked]
            outs.append(self._attend_one(q[a:b], keys, values, run_mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows attending causally to their own keys, q [B, H, n, D], k / v [B, Hkv, n, D] (a sliding layer:
        within its window)."""
        n = q.shape[2]
        if self.window is None or n <= self.window:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_band(n, self.window, q.device),
                                              scale=self.scale, enable_gqa=True)

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None, table: torch.Tensor | None = None) -> torch.Tensor:
        """One new token per row: q [B, 1, H, D], keys / values [B, Hkv, L, D], mask [B, 1, 1, L]; with
        `table` (a paged batch's slot table [B, L]) keys / values are the flat cache [slots, Hkv, D].

        The G query heads sharing a KV head go in as G query rows of that head, so the kernel
        reads each key and value once per KV head instead of once per query head (decode attention
        is bound by reading the cache; the gain: docs/architecture.md, "CPU decode path")."""
        batch, group = q.shape[0], self.num_heads // self.num_kv_heads
        folded = q.reshape(batch, self.num_kv_heads, group, self.head_dim)  # head h -> KV head h // group
        if table is not None:
            if cpu_decode.usable_paged(keys, values):  # pages read where they lie
                out = cpu_decode.attend_paged(folded, keys, values, table, mask, self.scale)
                return out.reshape(batch, self.num_heads, 1, self.head_dim)
            keys, values = keys[table].transpose(1, 2), values[table].transpose(1, 2)  # gathered: [B, Hkv, L, D]
        if cpu_decode.usable(keys, values):  # the arena's views on CPU: slot by slot
            out = cpu_decode.attend(folded, keys, values, mask, self.scale)
        else:
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(batch, self.num_heads, 1, self.head_dim)

    def _packed_write(self, q, k, v, ctx: Packed, cache: KVView) -> None:
        """Packed rows' K and V into their arena slots; with `observe`, each row's window scores too."""
        k_flat, v_flat = cache
        k_flat.index_copy_(0, ctx.write_flat, k[0])
        v_flat.index_copy_(0, ctx.write_flat, v[0])
        if ctx.observe:  # ctx.scores: [N], each row's keys scored by its own last queries (segment-sparse,
            # which sliding-window models refuse: the scores here are causal, not banded)
            scores = [self._window_scores(q_r.transpose(1, 2), k_r.transpose(1, 2), ctx.observe, None).reshape(-1)
                      for q_r, k_r in split_rows(ctx.row_lengths, q, k)]
            ctx.scores += torch.cat(scores)

    def _packed(self, q, k, v, ctx: Packed, cache: KVView) -> torch.Tensor:
        """Packed rows: each attends causally to its own tokens -> [B, H, n, D] for rows of one
        length, else [1, H, N, D] (both read back as the packed sequence)."""
        self._packed_write(q, k, v, ctx, cache)
        outs = [self._causal(q_r.transpose(1, 2), k_r.transpose(1, 2), v_r.transpose(1, 2))
                for q_r, k_r, v_r in split_rows(ctx.row_lengths, q, k, v)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # one batch: no copy

    def _packed_trees(self, q, k, v, ctx: PackedTrees) -> torch.Tensor:
        """Scoring rows packed end to end, no cache: each row causal over its own keys, then its tree
        queries (if any) recomputed under their own mask -> [1, H, N, D]. Per row, the causal kernel
        skips the masked half, which one [T, T] mask over a padded batch cannot."""
        if self.window is not None:
            raise ValueError("packed token trees serve models without sliding-window layers")
        bounds = torch.tensor((0, *ctx.row_lengths)).cumsum(0).tolist()
        outs = []
        for a, b, tree in zip(bounds[:-1], bounds[1:], ctx.trees, strict=True):
            q_r, k_r, v_r = q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2)
            out = F.scaled_dot_product_attention(q_r, k_r, v_r, is_causal=True, scale=self.scale, enable_gqa=True)
            if tree is not None:
                idx, visible = tree
                out[:, :, idx] = F.scaled_dot_product_attention(q_r[:, :, idx], k_r, v_r, attn_mask=visible,
                                                                scale=self.scale, enable_gqa=True)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _packed_last(self, q, k, v, ctx: Packed, cache: KVView) -> torch.Tensor:
        """Packed rows, final layer: every token's K and V into the arena, but only each row's last
        query attends (to its whole row, so no causal mask) -> [1, H, rows, D]."""
        self._packed_write(q, k, v, ctx, cache)
        if ctx.final is not None:
            ctx.final.q, ctx.final.k, ctx.final.v = q, k, v
        first = 0 if self.window is None else -self.window  # a sliding layer's last query: its last keys only
        outs = [self._attend_one(q_r[:, -1:], k_r[:, first:].transpose(1, 2), v_r[:, first:].transpose(1, 2), None)
                for q_r, k_r, v_r in split_rows(ctx.row_lengths, q, k, v)]  # [rows, H, 1, D] each
        return torch.cat(outs, dim=0).transpose(0, 2)

    def attend_positions(self, final: FinalLayerInputs, row_lengths: tuple[int, ...],
                         index: torch.Tensor) -> torch.Tensor:
        """Attention output of the packed positions `index` (ascending) from the queries, keys and
        values a `last_only` packed pass kept: each query sees its own row's keys up to itself
        -> [1, n, hidden] (after o_proj).

        Rows of one length go through one kernel call, their picked queries padded to the most any of
        them has (a padded query sees its row's first key and is dropped after). The bookkeeping is on
        the host, read once: on a GPU, a read per row would wait for the previous row's kernel."""
        if self.window is not None:
            raise ValueError("attend_positions serves layers without a sliding window")
        device = final.q.device
        picked_all = index.cpu()
        bounds = [0, *torch.tensor(row_lengths).cumsum(0).tolist()]
        cuts = torch.searchsorted(picked_all, torch.tensor(bounds)).tolist()
        by_length: dict[int, list[int]] = {}
        for r, n in enumerate(row_lengths):
            if cuts[r + 1] > cuts[r]:
                by_length.setdefault(n, []).append(r)
        outs: list[tuple[list[int], torch.Tensor]] = []  # (rows, their picked outputs [n, H * D] in order)
        for length, rows in by_length.items():
            counts = [cuts[r + 1] - cuts[r] for r in rows]
            most = max(counts)
            local = torch.zeros(len(rows), most, dtype=torch.long)  # row-local query positions; pads: 0
            valid = torch.zeros(len(rows), most, dtype=torch.bool)
            for i, (r, c) in enumerate(zip(rows, counts, strict=True)):
                local[i, :c] = picked_all[cuts[r] : cuts[r + 1]] - bounds[r]
                valid[i, :c] = True
            starts = torch.tensor([bounds[r] for r in rows])
            # query at row position p sees keys 0..p of its row
            visible = (torch.arange(length)[None, None] <= local[:, :, None])[:, None].to(device)
            keys = (starts[:, None] + torch.arange(length)).to(device)  # [R, length] packed positions
            q = final.q[0, (starts[:, None] + local).to(device)].transpose(1, 2)  # [R, H, most, D]
            k, v = final.k[0, keys].transpose(1, 2), final.v[0, keys].transpose(1, 2)  # [R, Hkv, length, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scale, enable_gqa=True)
            flat = torch.arange(valid.numel()).view_as(valid)[valid]  # host-side pick (a mask would read the device)
            outs.append((rows, out.transpose(1, 2).flatten(-2).flatten(0, 1).index_select(0, flat.to(device))))
        if len(outs) == 1:  # every row of one length: already in index order
            out = outs[0][1]
        else:  # rows of several lengths: each picked output back to its place in `index`
            out = torch.empty(len(picked_all), outs[0][1].shape[-1], dtype=outs[0][1].dtype, device=device)
            for rows, values in outs:
                at = torch.cat([torch.arange(cuts[r], cuts[r + 1]) for r in rows])
                out[at.to(device)] = values
        return self.o_proj.forward(out[None])

    def _paged(self, q, k, v, ctx: Paged, cache: KVView) -> torch.Tensor:
        batch, seq = q.shape[:2]
        k_flat, v_flat = cache  # [slots, Hkv, D]
        slots = ctx.write_slots.reshape(-1)
        k_flat[slots] = k.reshape(batch * seq, self.num_kv_heads, self.head_dim)
        v_flat[slots] = v.reshape(batch * seq, self.num_kv_heads, self.head_dim)
        mask = ctx.attn_mask if self.window is None else ctx.window_mask
        if seq == 1:  # a decode step
            return self._attend_one(q, k_flat, v_flat, mask, table=ctx.slot_table)
        keys = k_flat[ctx.slot_table].transpose(1, 2)  # gather: [B, Hkv, L, D]
        values = v_flat[ctx.slot_table].transpose(1, 2)
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale,
                                              enable_gqa=True)

    def _extend(self, q, k, v, ctx: Extend, cache: KVView, last_only: bool = False) -> torch.Tensor:
        seq = q.shape[1]
        k_flat, v_flat = cache  # [slots, Hkv, D]
        begin, end = ctx.start + ctx.cached, ctx.start + ctx.cached + seq
        k_flat[begin:end] = k[0]
        v_flat[begin:end] = v[0]
        keys = k_flat[ctx.start : end][None].transpose(1, 2)  # [1, Hkv, cached + C, D]
        values = v_flat[ctx.start : end][None].transpose(1, 2)
        queries = q.transpose(1, 2)  # [1, H, C, D]
        mask = ctx.mask if self.window is None else ctx.window_mask
        if ctx.observe:
            ctx.scores += self._window_scores(queries, keys, ctx.observe, mask)[0]
        if last_only:  # the chunk's last query sees every slot: its row of the mask is the bias alone
            mask = None if mask is None else mask[:, :, -1:]
            return F.scaled_dot_product_attention(queries[:, :, -1:], keys, values, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=True)
        if mask is None and ctx.cached == 0:
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=self.scale,
                                                  enable_gqa=True)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale,
                                              enable_gqa=True)

    def _window_scores(self, queries: torch.Tensor, keys: torch.Tensor, observe: int,
                       mask: torch.Tensor | None) -> torch.Tensor:
        """SnapKV-style importance: attention the last `observe` queries [B, H, C, D] pay each key
        [B, Hkv, L, D], pooled over heads and queries -> [B, L]. `mask` [1, 1, C, L] (None: causal).

        SDPA does not return its weights, so the window's scores are recomputed here (W x L, small).
        """
        window = min(observe, queries.shape[2])
        total = keys.shape[2]
        q_win = queries[:, :, -window:].float()  # [1, H, W, D]
        # the query heads of one KV head as extra rows against that head's keys (no repeated keys)
        batch = queries.shape[0]
        q_win = q_win.reshape(batch, self.num_kv_heads, -1, self.head_dim)
        logits = (q_win @ keys.float().transpose(-1, -2)).view(batch, self.num_heads, window, total).mul_(self.scale)
        if mask is not None:
            logits += mask[:, :, -window:].float()
        else:  # causal: only the window's own keys can lie in a query's future
            future = torch.ones(window, window, dtype=torch.bool, device=queries.device).triu_(1)
            logits[..., total - window :].masked_fill_(future, float("-inf"))
        scores = logits.softmax(dim=-1).mean(dim=(1, 2))  # [B, L]
        if self.shard is not None:  # the mean over every rank's heads: each rank merges the same groups
            self.shard.comm.all_reduce_(scores).div_(self.shard.size)
        return scores


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 choice: IndexerChoice | None = None, shard: TensorShard | None = None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        # a tensor-parallel rank's attention and MLP outputs are partial sums, added up across the ranks
        self.comm = shard.comm if shard is not None else None
        self.input_norm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.attn: Attention | MLAttention = (Attention(cfg, layer, dtype, device, shard) if cfg.mla is None else
                                              MLAttention(cfg, layer, dtype, device, choice or IndexerChoice()))
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        if cfg.moe is not None and cfg.moe.sparse_layers[layer]:
            self.mlp: GatedMLP | SparseMoE = SparseMoE(cfg.moe, cfg.hidden_size, dtype, device)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        sandwich = cfg.flags.sandwich_norm
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps, dtype, device) if sandwich else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps, dtype, device) if sandwich else None

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: KVView | None, last_only: bool = False
                ) -> torch.Tensor:
        ends = meta.last_tokens(x.device) if last_only else None  # the residual stream of each row's last token
        return self.block(x, lambda h: self.attn.forward(h, meta, cache, last_only), ends)

    def block(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor],
              keep: torch.Tensor | None = None) -> torch.Tensor:
        """Norms, residuals and MLP around `attend` (normed x -> attention output): the one place the
        layer's structure lives, shared with the ONNX export, whose attention carries its own cache.
        `keep`: `attend` returned only these positions of x's sequence; the rest of the layer runs on them."""
        h = attend(self.input_norm.forward(x))
        if self.comm is not None:
            self.comm.all_reduce_(h)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm.forward(h)
        if keep is not None:
            x = x[:, keep]
        x = h.add_(x)  # h is this layer's fresh output: the residual sum needs no new tensor
        h = self.mlp.forward(self.mlp_norm.forward(x))
        if self.comm is not None:
            self.comm.all_reduce_(h)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm.forward(h)
        return h.add_(x)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 shard: TensorShard | None = None) -> None:
        """`shard`: build one tensor-parallel rank's part of the model (`models.parallel`); `config`
        stays the whole model's, `local_config` is the rank's shapes (its heads, its columns)."""
        super().__init__()
        self.config, self.shard = cfg, shard
        self.local_config = local = rank_config(cfg, shard.size) if shard is not None else cfg
        vocab_rows = shard.vocab_rows(cfg.vocab_size) if shard is not None else cfg.vocab_size
        self.embed = _param((vocab_rows, cfg.hidden_size), dtype, device)
        choice = IndexerChoice()  # sparse attention: shared layers follow the last full indexer layer's choice
        self.layers = nn.ModuleList(DecoderLayer(local, i, dtype, device, choice, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = Linear(vocab_rows, cfg.hidden_size, False, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed
        self.rotary: RotaryTable | None = None

    def build_rotary(self, max_positions: int) -> None:
        """(Re)build the RoPE table; the engine grows it when a rolling merge runs past a row's slots."""
        if self.rotary is not None and self.rotary.max_positions >= max_positions:
            return
        cfg = self.config
        self.rotary = RotaryTable(cfg.rope, cfg.rotary_dim, max_positions, self.embed.dtype, self.embed.device)

    def hidden_states(self, input_ids: torch.Tensor, meta: ForwardMeta,
                      caches: Sequence[KVView] | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-norm hidden states [B, T, hidden]; layer i writes and reads
        `caches[i]` (None: a `TeacherForced` pass, which keeps no cache)."""
        x = self.embed_tokens(input_ids)
        # `.forward` directly, here and inside the layers: nn.Module.__call__ (hooks, which nothing
        # here uses) costs a few microseconds per call, ~10 calls per layer per decode step.
        final = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == final and isinstance(meta, Packed) and meta.final is not None:
                meta.final.residual = x  # not written in place below: `block` adds into fresh tensors
            x = layer.forward(x, meta, None if caches is None else caches[i], meta.last_only and i == final)
        return self.norm.forward(x)

    def final_hidden_at(self, meta: Packed, index: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [n, hidden] of the packed positions `index` (ascending) after a
        `last_only` packed pass that kept its final layer's inputs (`meta.final`): the final layer
        runs for those positions only, so a caller that needs a few positions' logits pays for those."""
        final, layer = meta.final, self.layers[-1]
        if final is None or final.residual is None or final.q is None or not isinstance(layer.attn, Attention):
            raise ValueError("final_hidden_at needs a last_only packed pass of a standard-attention model that kept "
                             "its final layer's inputs (Packed.final)")
        attend = layer.attn.attend_positions  # reads `index` on the host: pass it from there
        hidden = layer.block(final.residual[:, index.to(final.residual.device)],
                             lambda _: attend(final, meta.row_lengths, index))
        return self.norm.forward(hidden)[0]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> embeddings [B, T, hidden]. A tensor-parallel rank looks up the ids in its
        rows of the vocabulary, zeros elsewhere, and the all-reduce fills in every other rank's rows
        (each id has exactly one nonzero term: the sum is exact)."""
        if self.shard is None:
            return F.embedding(input_ids, self.embed)
        first, stop = self.shard.vocab_range(self.config.vocab_size)
        local = input_ids - first
        outside = (input_ids < first) | (input_ids >= stop)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.shard.comm.all_reduce_(x.masked_fill_(outside[..., None], 0))

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, upcast: bool = True) -> torch.Tensor:
        """[..., hidden] -> float32 logits [..., vocab]; `weight`: a copy of the LM head's weight in
        another dtype to use instead (the hidden states cast to it); `upcast=False`: logits in the dtype
        the head computed them in (one full pass over [..., vocab] fewer). A tensor-parallel rank
        computes its vocabulary rows and all-gathers the rest, so every rank holds the same full logits
        (always float32)."""
        local = self.lm_head.forward(hidden) if weight is None else F.linear(hidden.to(weight.dtype), weight)
        if self.shard is None:
            return local.float() if upcast else local
        return self.shard.comm.all_gather_last(local.float())[..., : self.config.vocab_size]
