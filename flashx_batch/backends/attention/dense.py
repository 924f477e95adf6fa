"""Dense attention (multi-head, grouped-query, multi-query, sliding windows) on torch SDPA, one backend
per layout; registered for every device. `backends.attention.cpu` overrides the decode-query kernel.

The kind's contract (`models.decoder.Attention` calls it): `q` [B, T, H, D], `k` / `v` [B, T, Hkv, D]
after RoPE; the layer's cache is `(keys, values)`, each [slots, Hkv, D]; the output is [B', H, T', D]
with B' x T' = B x T (a packed pass returns its rows as one sequence or as a batch of equal rows), or
with `last_only` [1, H, rows, D], each row's last query. The layer gives `num_heads`, `num_kv_heads`,
`head_dim`, `scale`, `window` (a sliding layer's window, None: full attention), `layer` and `shard`
(a tensor-parallel rank, whose window scores are averaged over every rank's heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashx_batch.backends.attention.base import AttentionBackend, register
from flashx_batch.backends.attention.meta import (
    Decode,
    Extend,
    FinalLayerInputs,
    Packed,
    PackedTrees,
    Paged,
    TeacherForced,
    split_rows,
)


def window_band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, n] boolean: query i sees key j when j <= i and j > i - window (a sliding layer's causal band)."""
    i = torch.arange(n, device=device)
    offset = i[:, None] - i[None, :]
    return (offset >= 0) & (offset < window)


class DenseBackend(AttentionBackend):
    kind = "dense"

    def one_query(self, layer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None, table: torch.Tensor | None = None) -> torch.Tensor:
        """One new token per row: q [B, 1, H, D], keys / values [B, Hkv, L, D], mask [B, 1, 1, L]; with
        `table` (a paged batch's slot table [B, L]) keys / values are the flat cache [slots, Hkv, D]
        -> [B, H, 1, D].

        The G query heads sharing a KV head go in as G query rows of that head, so the kernel
        reads each key and value once per KV head instead of once per query head (decode attention
        is bound by reading the cache; the gain: docs/architecture.md, "CPU decode path")."""
        batch, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        folded = q.reshape(batch, layer.num_kv_heads, group, layer.head_dim)  # head h -> KV head h // group
        if table is not None:
            keys, values = keys[table].transpose(1, 2), values[table].transpose(1, 2)  # gathered: [B, Hkv, L, D]
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=layer.scale)
        return out.reshape(batch, layer.num_heads, 1, layer.head_dim)

    @staticmethod
    def causal(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows attending causally to their own keys, q [B, H, n, D], k / v [B, Hkv, n, D] (a sliding layer:
        within its window)."""
        n = q.shape[2]
        if layer.window is None or n <= layer.window:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_band(n, layer.window, q.device),
                                              scale=layer.scale, enable_gqa=True)

    @staticmethod
    def window_scores(layer, queries: torch.Tensor, keys: torch.Tensor, observe: int,
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
        q_win = q_win.reshape(batch, layer.num_kv_heads, -1, layer.head_dim)
        logits = (q_win @ keys.float().transpose(-1, -2)).view(batch, layer.num_heads, window, total).mul_(layer.scale)
        if mask is not None:
            logits += mask[:, :, -window:].float()
        else:  # causal: only the window's own keys can lie in a query's future
            future = torch.ones(window, window, dtype=torch.bool, device=queries.device).triu_(1)
            logits[..., total - window :].masked_fill_(future, float("-inf"))
        scores = logits.softmax(dim=-1).mean(dim=(1, 2))  # [B, L]
        if layer.shard is not None:  # the mean over every rank's heads: each rank merges the same groups
            layer.shard.comm.all_reduce_(scores).div_(layer.shard.size)
        return scores


@register()
class TeacherForcedSdpa(DenseBackend):
    """Rows right-padded to T, no cache: causal, or the caller's token-tree mask."""

    layout = TeacherForced

    def forward(self, q, k, v, layer, meta: TeacherForced, cache, last_only=False):
        self.check_last_only(last_only)
        if meta.visible is None:
            return self.causal(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        mask = meta.visible if layer.window is None else meta.window_visible
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask[:, None], scale=layer.scale, enable_gqa=True)


@register()
class PackedTreesSdpa(DenseBackend):
    layout = PackedTrees

    def forward(self, q, k, v, layer, meta: PackedTrees, cache, last_only=False):
        """Scoring rows packed end to end, no cache: each row causal over its own keys, then its tree
        queries (if any) recomputed under their own mask -> [1, H, N, D]. Per row, the causal kernel
        skips the masked half, which one [T, T] mask over a padded batch cannot."""
        self.check_last_only(last_only)
        if layer.window is not None:
            raise ValueError("packed token trees serve models without sliding-window layers")
        bounds = torch.tensor((0, *meta.row_lengths)).cumsum(0).tolist()
        outs = []
        for a, b, tree in zip(bounds[:-1], bounds[1:], meta.trees, strict=True):
            q_r, k_r, v_r = q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2)
            out = F.scaled_dot_product_attention(q_r, k_r, v_r, is_causal=True, scale=layer.scale, enable_gqa=True)
            if tree is not None:
                idx, visible = tree
                out[:, :, idx] = F.scaled_dot_product_attention(q_r[:, :, idx], k_r, v_r, attn_mask=visible,
                                                                scale=layer.scale, enable_gqa=True)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


@register()
class PackedSdpa(DenseBackend):
    """Prompts end to end without padding, K and V into their arena slots."""

    layout = Packed
    supports_last_only = True

    def forward(self, q, k, v, layer, meta: Packed, cache, last_only=False):
        self._write(q, k, v, layer, meta, cache)
        if last_only:
            return self._last(q, k, v, layer, meta)
        # each row attends causally to its own tokens -> [B, H, n, D] for rows of one length, else
        # [1, H, N, D] (both read back as the packed sequence)
        outs = [self.causal(layer, q_r.transpose(1, 2), k_r.transpose(1, 2), v_r.transpose(1, 2))
                for q_r, k_r, v_r in split_rows(meta.row_lengths, q, k, v)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # one batch: no copy

    def _write(self, q, k, v, layer, meta: Packed, cache) -> None:
        """Packed rows' K and V into their arena slots; with `observe`, each row's window scores too."""
        k_flat, v_flat = cache
        k_flat.index_copy_(0, meta.write_flat, k[0])
        v_flat.index_copy_(0, meta.write_flat, v[0])
        if meta.observe:  # meta.scores: [N], each row's keys scored by its own last queries (segment-sparse,
            # which sliding-window models refuse: the scores here are causal, not banded)
            scores = [self.window_scores(layer, q_r.transpose(1, 2), k_r.transpose(1, 2), meta.observe, None)
                      .reshape(-1) for q_r, k_r in split_rows(meta.row_lengths, q, k)]
            meta.scores += torch.cat(scores)

    def _last(self, q, k, v, layer, meta: Packed) -> torch.Tensor:
        """The final layer: only each row's last query attends (to its whole row, so no causal mask)
        -> [1, H, rows, D]; with `meta.final`, the layer's queries, keys and values are kept for
        `attend_positions`."""
        if meta.final is not None:
            meta.final.q, meta.final.k, meta.final.v = q, k, v
        first = 0 if layer.window is None else -layer.window  # a sliding layer's last query: its last keys only
        outs = [self.one_query(layer, q_r[:, -1:], k_r[:, first:].transpose(1, 2), v_r[:, first:].transpose(1, 2),
                               None)
                for q_r, k_r, v_r in split_rows(meta.row_lengths, q, k, v)]  # [rows, H, 1, D] each
        return torch.cat(outs, dim=0).transpose(0, 2)

    @staticmethod
    def attend_positions(layer, final: FinalLayerInputs, row_lengths: tuple[int, ...],
                         index: torch.Tensor) -> torch.Tensor:
        """Attention output of the packed positions `index` (ascending) from the queries, keys and
        values a `last_only` packed pass kept: each query sees its own row's keys up to itself
        -> [n, H * D] (before the output projection).

        Rows of one length go through one kernel call, their picked queries padded to the most any of
        them has (a padded query sees its row's first key and is dropped after). The bookkeeping is on
        the host, read once: on a GPU, a read per row would wait for the previous row's kernel."""
        if layer.window is not None:
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
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=layer.scale, enable_gqa=True)
            flat = torch.arange(valid.numel()).view_as(valid)[valid]  # host-side pick (a mask would read the device)
            outs.append((rows, out.transpose(1, 2).flatten(-2).flatten(0, 1).index_select(0, flat.to(device))))
        if len(outs) == 1:  # every row of one length: already in index order
            return outs[0][1]
        # rows of several lengths: each picked output back to its place in `index`
        out = torch.empty(len(picked_all), outs[0][1].shape[-1], dtype=outs[0][1].dtype, device=device)
        for rows, values in outs:
            at = torch.cat([torch.arange(cuts[r], cuts[r + 1]) for r in rows])
            out[at.to(device)] = values
        return out


@register()
class DecodeSdpa(DenseBackend):
    """One new token per row, rows in stripes or extents: each run of rows (`Decode.runs`) read in
    place through its strided view, up to its own longest row."""

    layout = Decode

    def forward(self, q, k, v, layer, meta: Decode, cache, last_only=False):
        self.check_last_only(last_only)
        k_flat, v_flat = cache
        k_flat.index_copy_(0, meta.write_flat, k[:, 0])  # row i's new token -> its slot
        v_flat.index_copy_(0, meta.write_flat, v[:, 0])
        return self.read(q, layer, meta, cache)

    def read(self, q, layer, meta: Decode, cache) -> torch.Tensor:
        """The step's queries [B, 1, H, D] against the cache, K and V of the new tokens written."""
        # rows of very different lengths split into runs read only as far as each needs
        outs, mask = [], meta.attn_mask
        for a, b, kv, masked in meta.runs:
            keys, values = kv[layer.layer]
            if layer.window is not None:  # the band every row of the run sees, whatever its length
                run_mask = meta.window_mask[a:b, ..., : keys.shape[-2]]
            else:
                run_mask = None if masked is None else mask[a:b, ..., :masked]
            outs.append(self.one_query(layer, q[a:b], keys, values, run_mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@register()
class PagedSdpa(DenseBackend):
    """Rows reading through slot tables (shared prefix segments)."""

    layout = Paged

    def forward(self, q, k, v, layer, meta: Paged, cache, last_only=False):
        self.check_last_only(last_only)
        batch, seq = q.shape[:2]
        k_flat, v_flat = cache  # [slots, Hkv, D]
        slots = meta.write_slots.reshape(-1)
        k_flat[slots] = k.reshape(batch * seq, layer.num_kv_heads, layer.head_dim)
        v_flat[slots] = v.reshape(batch * seq, layer.num_kv_heads, layer.head_dim)
        mask = meta.attn_mask if layer.window is None else meta.window_mask
        if seq == 1:  # a decode step
            return self.one_query(layer, q, k_flat, v_flat, mask, table=meta.slot_table)
        keys = k_flat[meta.slot_table].transpose(1, 2)  # gather: [B, Hkv, L, D]
        values = v_flat[meta.slot_table].transpose(1, 2)
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=layer.scale,
                                              enable_gqa=True)


@register()
class ExtendSdpa(DenseBackend):
    """A chunk appended to one row's flat region after its cached slots (rolling merge, the quality
    harness); cached slots carry their log-count bias in the mask."""

    layout = Extend
    supports_last_only = True

    def forward(self, q, k, v, layer, meta: Extend, cache, last_only=False):
        seq = q.shape[1]
        k_flat, v_flat = cache  # [slots, Hkv, D]
        begin, end = meta.start + meta.cached, meta.start + meta.cached + seq
        k_flat[begin:end] = k[0]
        v_flat[begin:end] = v[0]
        keys = k_flat[meta.start : end][None].transpose(1, 2)  # [1, Hkv, cached + C, D]
        values = v_flat[meta.start : end][None].transpose(1, 2)
        queries = q.transpose(1, 2)  # [1, H, C, D]
        mask = meta.mask if layer.window is None else meta.window_mask
        if meta.observe:
            meta.scores += self.window_scores(layer, queries, keys, meta.observe, mask)[0]
        if last_only:  # the chunk's last query sees every slot: its row of the mask is the bias alone
            mask = None if mask is None else mask[:, :, -1:]
            return F.scaled_dot_product_attention(queries[:, :, -1:], keys, values, attn_mask=mask, scale=layer.scale,
                                                  enable_gqa=True)
        if mask is None and meta.cached == 0:
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=layer.scale,
                                                  enable_gqa=True)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=layer.scale,
                                              enable_gqa=True)
