"""Tensor parallelism inside one replica: which part of the model each rank holds.

Megatron's split, as vLLM and SGLang use it: a block's input projections are column-parallel (each rank
computes its own attention heads, its own slice of every MLP's / expert's intermediate columns), its
output projections row-parallel (each rank's partial sums, added by one all-reduce per attention and
one per MLP: `DecoderLayer.block`). The embedding and the LM head are split by vocabulary rows
(`DecoderModel.embed_tokens`, `DecoderModel.logits`). Norms, routers, latent-attention down
projections and the sparse-attention indexer are small and replicated: every rank computes them on
the same all-reduced hidden states, so they agree bit for bit.

KV heads: rank r keeps KV heads r·Hkv/N … (r+1)·Hkv/N; with fewer KV heads than ranks each rank keeps
the one KV head its query heads read (replicated over N/Hkv ranks). A rank's KV cache is therefore its
heads only, in an arena of the same slots on every rank, so that one scheduler (rank 0's) plans for all.

`rank_config` gives the per-rank shapes (the decoder is built from it unchanged), `checkpoint_cut`
which part of each checkpoint tensor a rank reads (the loader never reads more of a weight into memory
than the rank's slice, so no rank ever holds the whole model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashx_batch.errors import ConfigError
from flashx_batch.models.config import ModelConfig

if TYPE_CHECKING:
    from flashx_batch.backends.distributed import Communicator


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of a replica of `size` ranks; `comm` carries its collectives (None: a model built
    only to read shapes, which never runs a forward)."""

    rank: int
    size: int
    comm: Communicator | None = None

    def vocab_rows(self, vocab: int) -> int:
        """Rows of the embedding / LM head each rank holds: the vocabulary split evenly, the last
        rank's share padded with zero rows (equal shapes for the all-gather)."""
        return -(-vocab // self.size)

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """The token ids [first, stop) this rank's rows hold (stop - first may be short of
        `vocab_rows` on the last rank)."""
        rows = self.vocab_rows(vocab)
        return min(vocab, self.rank * rows), min(vocab, (self.rank + 1) * rows)

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """The query heads [first, stop) this rank computes."""
        per = cfg.num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """The KV heads [first, stop) this rank keeps: its share, or the one its query heads read."""
        if cfg.num_kv_heads >= self.size:
            per = cfg.num_kv_heads // self.size
            return self.rank * per, (self.rank + 1) * per
        first = self.rank * cfg.num_kv_heads // self.size
        return first, first + 1


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model as one of `size` ranks holds it: its heads, KV heads and intermediate columns (the
    vocabulary stays whole here: the decoder splits it with `TensorShard.vocab_rows`). ConfigError,
    saying which sizes would work, when a dimension does not split evenly."""
    if size == 1:
        return cfg
    problems = []

    def check(what: str, count: int) -> None:
        if count % size:
            fits = [n for n in range(2, count + 1) if count % n == 0 and n <= 16]
            problems.append(f"{count} {what} (sizes that divide them: {fits or 'none'})")

    check("attention heads", cfg.num_heads)
    if cfg.mla is None and cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (a size must divide them or be a multiple of them)")
    if cfg.moe is None or not all(cfg.moe.sparse_layers):
        check("MLP intermediate columns", cfg.intermediate_size)
    moe = cfg.moe
    if moe is not None:
        check("expert intermediate columns", moe.intermediate)
        if moe.shared_intermediate:
            check("shared-expert intermediate columns", moe.shared_intermediate)
        moe = dataclasses.replace(moe, intermediate=moe.intermediate // size,
                                  shared_intermediate=moe.shared_intermediate // size)
    if problems:
        raise ConfigError(f"{cfg.architecture}: runtime.tensor_parallel_size={size} does not split "
                          f"{'; '.join(problems)}; pick a tensor_parallel_size that divides each.")
    kv_heads = cfg.num_kv_heads if cfg.mla is not None else max(1, cfg.num_kv_heads // size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=kv_heads,
                               intermediate_size=cfg.intermediate_size // size, moe=moe)


# which rows or columns of one checkpoint tensor a rank reads: (axis, first, stop); a rank reads one or
# more such pieces of a tensor, in order. RANK_ZERO_ONLY: read by rank 0 only (a row-parallel
# projection's bias: added once, after the sum)
Cut = tuple[int, int, int]
RANK_ZERO_ONLY: list[Cut] = []


def checkpoint_cut(name: str, part: int, parts: int, full: tuple[int, ...], local: tuple[int, ...],
                   cfg: ModelConfig, shard: TensorShard) -> list[Cut] | None:
    """The pieces of checkpoint tensor number `part` (of the `parts` fused into our parameter `name`,
    whose whole shape is `full` as rows and this rank's `local`) this rank reads; None: all of it.

    Named rules for what does not split evenly by part (fused q/k/v, a checkpoint that stores gate and
    up as one tensor, the vocabulary, row-parallel biases); everything else is cut along the one axis
    where its rank shape differs from the whole: an equal share of each fused part (gate and up, every
    expert) or of the columns."""
    if name in ("embed", "lm_head.weight"):
        first, stop = shard.vocab_range(cfg.vocab_size)
        return [(0, first, stop)]
    if name.endswith("attn.o_proj.bias"):
        return RANK_ZERO_ONLY if shard.rank else None
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        first, stop = shard.heads(cfg) if part == 0 else shard.kv_heads(cfg)
        return [(0, first * cfg.head_dim, stop * cfg.head_dim)]
    if tuple(full) == tuple(local):
        return None
    if full[0] != local[0]:
        if name.endswith("gate_up.weight") and parts == 1:  # gate and up stored fused (GLM): a share of each
            half, share = full[0] // 2, local[0] // 2
            return [(0, shard.rank * share, (shard.rank + 1) * share),
                    (0, half + shard.rank * share, half + (shard.rank + 1) * share)]
        share = local[0] // parts
        return [(0, shard.rank * share, (shard.rank + 1) * share)]
    share = local[1]
    return [(1, shard.rank * share, (shard.rank + 1) * share)]
