"""Latent attention (DeepSeek-V3, GLM-5's MLA with the DSA indexer), one backend per layout;
registered for every device.

The kind's contract (`models.mla.MLAttention` calls it): `q` = (q_nope [B, T, H, nope], rotated q_rope
[B, T, H, rope]), `k` = the cache entries [B, T, entry] (latent, rotary key, and for an indexer layer the
indexer's key), `v` = the indexer's (queries, head weights), or None for a layer without an indexer; the
layer's cache is one view [slots, 1, entry]; the output is [B', T', H, v_head_dim]. A backend writes the
entries and finds, per layout, the keys each query reads and which of them it sees; the attention
itself — the indexer's choice, the absorbed (one query per row) or expanded form — is the layer's
`attend(q_nope, q_rope, keys, visible, index, bias)`, the same for every layout.
"""

from __future__ import annotations

import torch

from flashx_batch.backends.attention.base import AttentionBackend, register
from flashx_batch.backends.attention.meta import Decode, Extend, Packed, Paged, TeacherForced, split_rows


def causal_visible(n: int, device: torch.device, cached: int = 0) -> torch.Tensor:
    """[n, cached + n] bool: query i (at position cached + i) sees keys 0..cached + i."""
    keys = torch.arange(cached + n, device=device)
    return keys[None, :] <= (torch.arange(n, device=device) + cached)[:, None]


def last_query(row_index):
    """An indexer's ((queries, weights), keys) cut to the last query."""
    if row_index is None:
        return None
    (q, weights), keys = row_index
    return (q[:, -1:], weights[:, -1:]), keys


class LatentBackend(AttentionBackend):
    kind = "latent"

    @staticmethod
    def index_keys(layer, index, keys: torch.Tensor):
        """The indexer's inputs for `keys` [B, L, entry]: ((queries, weights), its keys [B, L, Di]), or None."""
        return None if index is None else (index, keys[..., layer.spec.latent_dim :])


@register()
class TeacherForcedLatent(LatentBackend):
    layout = TeacherForced

    def forward(self, q, k, v, layer, meta: TeacherForced, cache, last_only=False):
        self.check_last_only(last_only)
        (q_nope, q_rot), entry, seq = q, k, k.shape[1]
        visible = causal_visible(seq, entry.device)[None] if meta.visible is None else meta.visible
        return layer.attend(q_nope, q_rot, entry, visible, self.index_keys(layer, v, entry))


@register()
class PackedLatent(LatentBackend):
    layout = Packed
    supports_last_only = True

    def forward(self, q, k, v, layer, meta: Packed, cache, last_only=False):
        (q_nope, q_rot), entry = q, k
        cache[0][meta.write_flat, 0, : entry.shape[-1]] = entry[0]
        outs = []
        for qn, qr, e, *idx in split_rows(meta.row_lengths, q_nope, q_rot, entry, *(v or ())):
            n = qn.shape[1]
            row_index = (tuple(idx), e[..., layer.spec.latent_dim :]) if v is not None else None
            if last_only:  # the row's last query sees its whole row: no mask
                outs.append(layer.attend(qn[:, -1:], qr[:, -1:], e, None, last_query(row_index)))
            else:
                outs.append(layer.attend(qn, qr, e, causal_visible(n, entry.device)[None], row_index))
        return torch.cat([o.reshape(-1, *o.shape[2:]) for o in outs])[None]  # [1, N or rows, H, v]


@register()
class DecodeLatent(LatentBackend):
    layout = Decode

    def forward(self, q, k, v, layer, meta: Decode, cache, last_only=False):
        self.check_last_only(last_only)
        (q_nope, q_rot), entry = q, k
        cache[0][meta.write_flat, 0, : entry.shape[-1]] = entry[:, 0]
        outs = []
        for a, b, kv, masked in meta.runs:
            keys = kv[layer.layer][0][:, 0]  # [rows, slots, entry]
            mask = meta.attn_mask[a:b, :, :, : keys.shape[1]] if masked is not None else None
            # the indexer needs the visible keys as booleans; attention itself reads the additive mask
            visible = mask[:, 0] > float("-inf") if layer.sparse and mask is not None else None
            row_index = None if v is None else ((v[0][a:b], v[1][a:b]), keys[..., layer.spec.latent_dim :])
            outs.append(layer.attend(q_nope[a:b], q_rot[a:b], keys, visible, row_index, mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@register()
class PagedLatent(LatentBackend):
    layout = Paged

    def forward(self, q, k, v, layer, meta: Paged, cache, last_only=False):
        self.check_last_only(last_only)
        (q_nope, q_rot), entry = q, k
        batch, seq, width = entry.shape
        flat = cache[0]
        flat[meta.write_slots.reshape(-1), 0, :width] = entry.reshape(batch * seq, width)
        keys = flat[meta.slot_table][:, :, 0]  # [B, L, entry]
        visible = meta.attn_mask[:, 0]  # [B, T, L]
        return layer.attend(q_nope, q_rot, keys, visible, self.index_keys(layer, v, keys))


@register()
class ExtendLatent(LatentBackend):
    layout = Extend
    supports_last_only = True

    def forward(self, q, k, v, layer, meta: Extend, cache, last_only=False):
        (q_nope, q_rot), entry = q, k
        seq, flat = entry.shape[1], cache[0]
        begin = meta.start + meta.cached
        flat[begin : begin + seq, 0, : entry.shape[-1]] = entry[0]
        keys = flat[meta.start : begin + seq, 0][None]  # [1, cached + C, entry]
        n = keys.shape[1]
        if meta.mask is None:
            visible, bias = causal_visible(seq, entry.device, n - seq)[None], None
        else:
            visible, bias = meta.mask[:, 0] > float("-inf"), meta.mask
        row_index = self.index_keys(layer, v, keys)
        if last_only:
            q_nope, q_rot, visible = q_nope[:, -1:], q_rot[:, -1:], visible[:, -1:]
            bias = None if bias is None else bias[:, :, -1:]
            row_index = last_query(row_index)
        return layer.attend(q_nope, q_rot, keys, visible, row_index, bias)
