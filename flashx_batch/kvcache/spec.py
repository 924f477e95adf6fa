"""`LayerCache`: what one layer keeps per token in the KV arena — the arena sizes itself from these.

Built from the model config (`ModelConfig.cache_spec`), one per layer:
- full keys and values: 2 parts of `heads` x `dim` (a sliding layer says its `window`; it still keeps
  a slot per position, since the window moves over the row);
- latent attention (DeepSeek-V3, GLM-5): 1 part, 1 head, `dim` = kv_lora_rank + qk_rope_head_dim,
  plus the indexer's key on GLM-5 layers that run one.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("kv", "latent")


@dataclass(frozen=True)
class LayerCache:
    kind: str  # "kv": keys and values; "latent": one compressed entry per token
    parts: int
    heads: int
    dim: int
    window: int | None = None  # a sliding layer's window (None: full attention)

    def __post_init__(self) -> None:
        if self.kind not in KINDS or min(self.parts, self.heads, self.dim) < 1:
            raise ValueError(f"not a layer cache: {self}")


def arena_shape(spec: tuple[LayerCache, ...]) -> tuple[int, int, int]:
    """(parts, heads, dim) of the arena's per-layer slot: the layers' own, which must agree on parts and
    heads; entries of different widths (GLM-5 layers without an indexer) are stored at the widest."""
    shapes = {(s.parts, s.heads) for s in spec}
    if len(shapes) != 1:
        raise ValueError(f"layers keep differently shaped caches {sorted(shapes)}; one arena holds one shape")
    parts, heads = shapes.pop()
    return parts, heads, max(s.dim for s in spec)


def slot_bytes(spec: tuple[LayerCache, ...], element_size: int) -> int:
    """Arena bytes of one slot across every layer (as the arena stores it: at the widest entry)."""
    parts, heads, dim = arena_shape(spec)
    return len(spec) * parts * heads * dim * element_size
