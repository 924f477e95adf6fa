"""Prefix cache: segment-sized token blocks whose KV already sits in the arena, found by hash chain.

Owned by one engine's scheduler (so one per Ray actor) and kept across batches and `generate` calls. Pure
integer bookkeeping over the arena's `SegmentAllocator`: the cache holds one reference on each
cached segment; every row reading it holds another, so a segment is reusable the moment both are
gone. Block i's key hashes block i's tokens *and* block i-1's key, so a hit on block i implies
the whole prefix before it matched: the KV inside is exactly what a full prefill would compute.

Eviction is least-recently-used over blocks only the cache still references, bounded by
`max_segments` (the `runtime.prefix_cache_tokens` memory cap).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from flashx_batch.kvcache.allocator import SegmentAllocator


def block_keys(tokens: list[int], segment_size: int, limit: int, adapter: int = 0) -> list[bytes]:
    """Chain keys of the full blocks within the first `limit` tokens; rows of another LoRA `adapter`
    (slot) get other keys (the same tokens have other KV there)."""
    keys, previous = [], (b"" if not adapter else f"adapter {adapter}".encode())
    for start in range(0, limit - segment_size + 1, segment_size):
        block = tokens[start : start + segment_size]
        previous = hashlib.blake2b(previous + b"|" + ",".join(map(str, block)).encode(), digest_size=16).digest()
        keys.append(previous)
    return keys


class PrefixCache:
    def __init__(self, allocator: SegmentAllocator, region: range, max_segments: int) -> None:
        self.allocator = allocator
        self.region = region  # segments reserved for cached blocks (never a batch stripe)
        self.max_segments = min(max_segments, len(region))
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # key -> segment, oldest first
        self.hits = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: list[bytes]) -> list[int]:
        """Segments of the longest cached chain at the start of `keys` (marks them recently used)."""
        found: list[int] = []
        for key in keys:
            segment = self._blocks.get(key)
            if segment is None:
                break
            self._blocks.move_to_end(key)
            found.append(segment)
        self.lookups += len(keys)
        self.hits += len(found)
        return found

    def reserve(self, count: int) -> list[int] | None:
        """Segments for `count` new blocks, evicting idle blocks if needed; None if it cannot."""
        if count > self.max_segments:
            return None
        while len(self._blocks) + count > self.max_segments or self.allocator.free_in(self.region) < count:
            if not self._evict_one():
                return None
        return self.allocator.allocate(count, within=self.region)

    def insert(self, key: bytes, segment: int) -> None:
        """Adopt a reserved segment now holding block `key` (the cache keeps its reference)."""
        self._blocks[key] = segment

    def forget(self, key: bytes) -> None:
        """Drop a block whose KV was never computed (the step that would have computed it failed)."""
        segment = self._blocks.pop(key, None)
        if segment is not None:
            self.allocator.release([segment])

    def _evict_one(self) -> bool:
        for key, segment in self._blocks.items():
            if self.allocator.refcount[segment] == 1:  # nobody but the cache reads it
                del self._blocks[key]
                self.allocator.release([segment])
                return True
        return False

    def clear(self) -> None:
        for segment in self._blocks.values():
            self.allocator.release([segment])
        self._blocks.clear()
