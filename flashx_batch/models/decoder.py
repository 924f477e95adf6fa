"""One decoder for every supported family; `FamilyFlags` switch the few places they differ.

Called by the torch model runner, which builds one `backends.attention.meta` object per call and
hands each layer its cache as plain `(keys, values)` views (never the arena). Weights arrive already
fused (`qkv`, `gate_up`) from `models.loader`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends.attention import AttentionBackend, AttentionSet, select
from flashx_batch.backends.attention.meta import FinalLayerInputs, ForwardMeta, Packed
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.layers import GatedMLP, Linear, RMSNorm, RotaryTable, apply_rotary_
from flashx_batch.models.lora import LoraSet, RowAdapters
from flashx_batch.models.mla import IndexerChoice, MLAttention
from flashx_batch.models.moe import SparseMoE
from flashx_batch.models.parallel import TensorShard, rank_config

# one layer's cache: keys and values, [slots, kv_heads, head_dim] each; for latent attention (`models.mla`)
# one [slots, 1, entry] view of its latents
KVView = tuple[torch.Tensor, ...]


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

    def forward(self, x: torch.Tensor, meta: ForwardMeta, backend: AttentionBackend, cache: KVView | None,
                last_only: bool = False) -> torch.Tensor:
        """Projections and RoPE here; the attention itself (K / V writes, the kernel) is `backend`'s, the
        one its `AttentionSet` picked for this pass's layout."""
        batch, seq = x.shape[:2]
        q, k, v = self.project(x, meta.cos, meta.sin)
        out = backend.forward(q, k, v, self, meta, cache, last_only)  # [B', H, T', D]
        if last_only:
            seq = out.shape[2]
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj.forward(out)

    def attend_positions(self, backend: AttentionBackend, final: FinalLayerInputs, row_lengths: tuple[int, ...],
                         index: torch.Tensor) -> torch.Tensor:
        """The packed positions `index` of a `last_only` packed pass that kept `final` -> [1, n, hidden]
        (after o_proj): see `PackedSdpa.attend_positions`."""
        return self.o_proj.forward(backend.attend_positions(self, final, row_lengths, index)[None])


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

    def forward(self, x: torch.Tensor, meta: ForwardMeta, backend: AttentionBackend, cache: KVView | None,
                last_only: bool = False) -> torch.Tensor:
        ends = meta.last_tokens(x.device) if last_only else None  # the residual stream of each row's last token
        return self.block(x, lambda h: self.attn.forward(h, meta, backend, cache, last_only), ends)

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
        # a sequence classifier's score head stands where the LM head would ([num_labels, hidden])
        head_rows = cfg.classifier.num_labels if cfg.classifier is not None else vocab_rows
        self.lm_head = Linear(head_rows, cfg.hidden_size, False, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed
        self.rotary: RotaryTable | None = None
        self.attention_kind = "latent" if cfg.mla is not None else "dense"
        self._attention: AttentionSet | None = None
        self.lora: LoraSet | None = None  # LoRA adapters stacked into the target linears (`models.lora`)

    @property
    def attention(self) -> AttentionSet:
        """Every layout's attention backend for the device the weights are on and this model's attention
        kind (`backends.attention.select`), picked at the first forward pass there."""
        device = self.embed.device
        if self._attention is None or self._attention.device != device:
            self._attention = select(device, self.attention_kind)
        return self._attention

    def build_rotary(self, max_positions: int) -> None:
        """(Re)build the RoPE table; the engine grows it when a rolling merge runs past a row's slots."""
        if self.rotary is not None and self.rotary.max_positions >= max_positions:
            return
        cfg = self.config
        self.rotary = RotaryTable(cfg.rope, cfg.rotary_dim, max_positions, self.embed.dtype, self.embed.device)

    def hidden_states(self, input_ids: torch.Tensor, meta: ForwardMeta,
                      caches: Sequence[KVView] | None = None, adapters: RowAdapters | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-norm hidden states [B, T, hidden]; layer i writes and reads
        `caches[i]` (None: a `TeacherForced` pass, which keeps no cache); every layer's attention runs
        on the backend `self.attention` holds for `meta`'s layout. `adapters`: each row's LoRA adapter
        (`models.lora`; None: the base model for every row)."""
        if self.lora is None:
            if adapters is not None:
                raise RuntimeError("LoRA adapters asked of a model that loaded none")
            return self._hidden_states(input_ids, meta, caches)
        self.lora.begin(adapters, input_ids.shape, getattr(meta, "row_lengths", None), meta.last_only)
        try:
            return self._hidden_states(input_ids, meta, caches)
        finally:
            self.lora.end()

    def _hidden_states(self, input_ids: torch.Tensor, meta: ForwardMeta, caches: Sequence[KVView] | None
                       ) -> torch.Tensor:
        backend = self.attention.for_meta(meta)
        x = self.embed_tokens(input_ids)
        # `.forward` directly, here and inside the layers: nn.Module.__call__ (hooks, which nothing
        # here uses) costs a few microseconds per call, ~10 calls per layer per decode step.
        final = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == final and isinstance(meta, Packed) and meta.final is not None:
                meta.final.residual = x  # not written in place below: `block` adds into fresh tensors
            x = layer.forward(x, meta, backend, None if caches is None else caches[i], meta.last_only and i == final)
        return self.norm.forward(x)

    def final_hidden_at(self, meta: Packed, index: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [n, hidden] of the packed positions `index` (ascending) after a
        `last_only` packed pass that kept its final layer's inputs (`meta.final`): the final layer
        runs for those positions only, so a caller that needs a few positions' logits pays for those."""
        final, layer = meta.final, self.layers[-1]
        if final is None or final.residual is None or final.q is None or not isinstance(layer.attn, Attention):
            raise ValueError("final_hidden_at needs a last_only packed pass of a standard-attention model that kept "
                             "its final layer's inputs (Packed.final)")
        backend = self.attention.for_meta(meta)
        # `attend_positions` reads `index` on the host: pass it from there
        hidden = layer.block(final.residual[:, index.to(final.residual.device)],
                             lambda _: layer.attn.attend_positions(backend, final, meta.row_lengths, index))
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
