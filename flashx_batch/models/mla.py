"""Multi-head latent attention (DeepSeek-V3, GLM-5) and the DSA indexer (GLM-5).

The cache keeps, per token and layer, one vector: the normalised latent (`kv_lora_rank` values), the
rotated key part shared by every head (`qk_rope_head_dim`), and for an indexer layer the indexer's key
(`DSASpec.head_dim`) — the arena's `latent_cache_spec`. Two ways to attend over it:

- expanded (prefill, several queries per row): `kv_b` turns the latents into per-head keys and values
  and ordinary attention runs on them, as `transformers` does;
- absorbed (decode, one query per row): `kv_b`'s key half is folded into the query and its value half
  applied after attention, so attention reads the latents themselves, one "key head" shared by every
  query head: a step reads `latent_dim` values per slot instead of heads x (key + value) values.

DSA: a full layer's indexer scores every visible key per query (ReLU'd multi-head dot products, weighted
per head) and each query attends only to its `index_topk` best; shared layers reuse the last full
layer's choice within the same forward pass (`IndexerChoice`). A query that sees at most `index_topk`
keys attends to all of them — that is dense attention, and nothing is scored.

RoPE: the checkpoints store rotary channels as interleaved pairs; `transformers` de-interleaves them to
halves before rotating, and so do we (a gather of the rotary slice), so cached keys match its layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends.attention import AttentionBackend
from flashx_batch.backends.attention.meta import ForwardMeta
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.layers import Linear, RMSNorm, apply_rotary_

NORM_EPS = 1e-6  # the latent and query norms' epsilon in the reference (not config.json's rms_norm_eps)


class IndexerChoice:
    """The keys each query keeps, from the last full indexer layer of the current forward pass: one
    entry per attention call of that pass (a row, a run of decode rows), in call order. None where
    every query keeps every visible key."""

    def __init__(self) -> None:
        self.keep: list[torch.Tensor | None] = []


def top_keys(index: torch.Tensor, k: int) -> torch.Tensor:
    """index [..., L] -> bool [..., L]: the k best keys of each query, ties at the k-th score taken in key
    order (the earliest first). `torch.topk` leaves ties to the kernel, and on a CPU the keys it picks
    among equal scores depend on the row's width: a prefill row (L columns, -inf past the query) and
    the same query at decode (its own length) then keep different keys. The indexer ties often —
    every key whose heads' ReLU all read 0 scores exactly 0 — so the choice must not depend on the
    layout (docs/architecture.md, "DSA: the indexer's semantics")."""
    kth = index.topk(k, dim=-1).values[..., -1:]  # the k-th best score of each query
    above = index > kth
    tied = index == kth
    need = k - above.sum(-1, keepdim=True)  # slots left for keys at the k-th score
    return above | (tied & (tied.cumsum(-1) <= need))


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        dsa, mla = cfg.dsa, cfg.mla
        self.heads, self.head_dim, self.topk, self.rope = dsa.heads, dsa.head_dim, dsa.index_topk, mla.qk_rope_head_dim
        self.wq_b = Linear(dsa.heads * dsa.head_dim, mla.q_lora_rank, False, dtype, device)
        self.wk = Linear(dsa.head_dim, cfg.hidden_size, False, dtype, device)
        self.k_norm = nn.LayerNorm(dsa.head_dim, eps=1e-6, dtype=dtype, device=device)
        self.k_norm.requires_grad_(False)
        # float32 whatever the model's dtype, as the reference keeps it (transformers' _keep_in_fp32_modules):
        # the head weights scale every score the top-k compares
        self.weights_proj = Linear(dsa.heads, cfg.hidden_size, False, torch.float32, device)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> index queries [B, T, Hi, Di], keys [B, T, Di] (what the cache keeps), head weights [B, T, Hi]."""
        q = self.wq_b.forward(q_resid).unflatten(-1, (self.heads, self.head_dim))
        k = self.k_norm(self.wk.forward(x))[:, :, None]
        q = torch.cat((_rotate(q[..., : self.rope], cos, sin), q[..., self.rope :]), dim=-1)
        k = torch.cat((_rotate(k[..., : self.rope], cos, sin), k[..., self.rope :]), dim=-1)[:, :, 0]
        weights = self.weights_proj.forward(x.float()) * self.heads**-0.5
        return q, k, weights

    def choose(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
               ) -> torch.Tensor | None:
        """q [B, T, Hi, Di], weights [B, T, Hi], keys [B, L, Di], visible bool [B, T, L] -> the keys each
        query keeps, bool [B, T, L] (within `visible`); None when L <= index_topk (all of them)."""
        if keys.shape[1] <= self.topk:
            return None
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5
        index = torch.matmul(weights.unsqueeze(-2), F.relu(scores)).squeeze(-2)  # [B, T, L]
        index = index.masked_fill(~visible, float("-inf"))
        return top_keys(index, self.topk) & visible


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 choice: IndexerChoice) -> None:
        super().__init__()
        mla = cfg.mla
        self.layer, self.num_heads, self.spec = layer, cfg.num_heads, mla
        self.rank, self.nope, self.rope, self.v_dim = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                                       mla.v_head_dim)
        bias = cfg.attention_bias
        self.q_a = Linear(mla.q_lora_rank, cfg.hidden_size, bias, dtype, device)
        self.q_a_norm = RMSNorm(mla.q_lora_rank, NORM_EPS, dtype, device)
        self.q_b = Linear(cfg.num_heads * (self.nope + self.rope), mla.q_lora_rank, False, dtype, device)
        self.kv_a = Linear(mla.latent_dim, cfg.hidden_size, bias, dtype, device)
        self.kv_a_norm = RMSNorm(self.rank, NORM_EPS, dtype, device)
        self.kv_b = Linear(cfg.num_heads * (self.nope + self.v_dim), self.rank, False, dtype, device)
        self.o_proj = Linear(cfg.hidden_size, cfg.num_heads * self.v_dim, bias, dtype, device)
        dsa = cfg.dsa
        self.indexer = Indexer(cfg, dtype, device) if dsa is not None and dsa.full_layers[layer] else None
        self.sparse = dsa is not None  # a shared layer (no indexer of its own) follows `choice`
        self.choice = choice
        self._calls = 0  # attention calls so far in this forward pass (indexes `choice.keep`)

    # ---- projections ------------------------------------------------------------------------
    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, hidden] -> q_nope [B, T, H, nope], rotated q_rope [B, T, H, rope], the cache entry
        [B, T, latent (+ indexer key)], and the index queries and head weights (None without an indexer)."""
        q_resid = self.q_a_norm.forward(self.q_a.forward(x))
        q = self.q_b.forward(q_resid).unflatten(-1, (self.num_heads, self.nope + self.rope))
        q_nope, q_rot = q[..., : self.nope], _rotate(q[..., self.nope :], cos, sin, self.spec.rope_interleave)
        kv = self.kv_a.forward(x)
        latent = self.kv_a_norm.forward(kv[..., : self.rank])
        k_rot = _rotate(kv[..., None, self.rank :], cos, sin, self.spec.rope_interleave)[:, :, 0]
        entry, index = torch.cat((latent, k_rot), dim=-1), None
        if self.indexer is not None:
            iq, ik, weights = self.indexer.project(x, q_resid, cos, sin)
            entry, index = torch.cat((entry, ik.to(entry.dtype)), dim=-1), (iq, weights)
        return q_nope, q_rot, entry, index

    # ---- the forward pass -------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: ForwardMeta, backend: AttentionBackend, cache,
                last_only: bool = False) -> torch.Tensor:
        """Projections and RoPE here; `backend` (a latent one, for this pass's layout) writes the cache
        entries and calls `attend` with the keys each query reads."""
        q_nope, q_rot, entry, index = self.project(x, meta.cos, meta.sin)
        if self.indexer is not None:
            self.choice.keep = []
        self._calls = 0
        out = backend.forward((q_nope, q_rot), entry, index, self, meta, cache, last_only)
        return self.o_proj.forward(out.flatten(-2))

    # ---- attention over latents -------------------------------------------------------------
    def attend(self, q_nope: torch.Tensor, q_rot: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None,
                index=None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Queries [B, T, H, *] over cache entries `keys` [B, L, entry] -> [B, T, H, v]. `visible` bool
        [B or 1, T, L] (None: every key, no mask); `bias` an additive [B, 1, T or 1, L] mask (merge bias)
        used instead of it where given; `index` ((queries, weights), index keys [B, L, Di]) for a full
        indexer layer."""
        keep = self._select(index, visible, q_nope.shape[1], keys.shape[1])
        mask = bias if bias is not None else None if visible is None else visible[:, None]
        if keep is not None:
            mask = keep[:, None] if bias is None else bias.masked_fill(~keep[:, None], float("-inf"))
        if q_nope.shape[1] == 1:
            return self._absorbed(q_nope, q_rot, keys, mask)
        return self._expanded(q_nope, q_rot, keys, mask)

    def _select(self, index, visible: torch.Tensor | None, queries: int, length: int) -> torch.Tensor | None:
        if not self.sparse:
            return None
        if self.indexer is not None:
            (q, weights), keys = index
            if visible is None:
                visible = torch.ones(q.shape[0], queries, length, dtype=torch.bool, device=q.device)
            keep = self.indexer.choose(q, weights, keys, visible.expand(q.shape[0], -1, -1))
            self.choice.keep.append(keep)
            return keep
        keep = self.choice.keep[self._calls]
        self._calls += 1
        # a final layer computing only each row's last query (`last_only`) keeps that query's choice
        return None if keep is None else keep[:, -queries:]

    def _expanded(self, q_nope, q_rot, keys, mask) -> torch.Tensor:
        latent, k_rot = keys[..., : self.rank], keys[..., self.rank : self.spec.latent_dim]
        kv = self.kv_b.forward(latent).unflatten(-1, (self.num_heads, self.nope + self.v_dim))  # [B, L, H, nope+v]
        k = torch.cat((kv[..., : self.nope], k_rot[:, :, None].expand(-1, -1, self.num_heads, -1)), dim=-1)
        v = kv[..., self.nope :]
        q = torch.cat((q_nope, q_rot), dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=self.spec.scale)
        return out.transpose(1, 2)

    def _absorbed(self, q_nope, q_rot, keys, mask) -> torch.Tensor:
        """One query per row: the query heads as rows of one head over the latents themselves."""
        w_uk, w_uv = self._absorb_weights()
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope[:, 0], w_uk)  # [B, H, rank]
        q = torch.cat((q_lat, q_rot[:, 0].to(q_lat.dtype)), dim=-1)[:, None]  # [B, 1, H, latent]
        k = keys[:, None, :, : self.spec.latent_dim]  # [B, 1, L, latent]
        out = F.scaled_dot_product_attention(q, k, k[..., : self.rank], attn_mask=mask, scale=self.spec.scale)
        return torch.einsum("bhr,hvr->bhv", out[:, 0], w_uv)[:, None]  # [B, 1, H, v]

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's key and value halves per head, [H, nope, rank] and [H, v, rank], contiguous: cut once
        (not on every decode step of every layer), again only if the weight is replaced or written to."""
        weight = self.kv_b.weight
        if getattr(self, "_absorb_for", None) != (id(weight), weight._version):
            w = weight.detach().view(self.num_heads, self.nope + self.v_dim, self.rank)
            self._absorb = (w[:, : self.nope].contiguous(), w[:, self.nope :].contiguous())
            self._absorb_for = (id(weight), weight._version)
        return self._absorb


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """RoPE on x [B, T, H, rope] (a view of a projection) into a new tensor, halves layout; interleaved
    pairs are first de-interleaved (x0, x2, … then x1, x3, …) as the reference does."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if interleaved else x.clone()
    return apply_rotary_(x, cos, sin, False)
