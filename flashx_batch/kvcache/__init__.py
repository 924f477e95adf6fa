"""The KV cache: device storage (`arena.KVArena`) and its plain-Python bookkeeping.

- `allocator.SegmentAllocator`: free list and reference counts over fixed-size segments.
- `geometry.ArenaGeometry`: how the arena's slots divide into segments and stripes (the current
  layout, what a layout for rows of a given length would be).
- `prefix_cache.PrefixCache`: hash-chained cache of prompt blocks held in arena segments.
- `arena.KVArena`: the one tensor `[layers, 2, slots, kv_heads, head_dim]`, per-slot merge bias,
  slot copies and the strided views attention reads.

Only `arena` imports torch: the scheduler works on the other three and never touches a tensor.
Glossary (segment, slot, stripe, extent, run, page): docs/architecture.md.
"""
