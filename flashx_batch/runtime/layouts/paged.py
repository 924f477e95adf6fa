"""`PagedLayout`: rows whose prompts start with blocks already in (or just added to) the prefix cache.

Each row's slot table is its shared prefix segments (read-only, reference-counted) followed by its
own; attention gathers through the table. A block shared by two rows of a batch, or already cached,
is computed once into a cache segment (`share_prefixes`). Paged batches take no refill: the rows
after one may share prefixes again in the next paged batch.
"""

from __future__ import annotations

from collections import deque

from flashx_batch.kvcache.allocator import SegmentAllocator
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.kvcache.prefix_cache import PrefixCache, block_keys
from flashx_batch.runtime.layouts.base import Layout
from flashx_batch.runtime.plan import KVOp, NewRow, PagedDecode, PagedPrefill, PrefixBlock
from flashx_batch.runtime.results import KVAccount
from flashx_batch.runtime.rows import Row


class SharedPrefixes:
    """What `share_prefixes` found for a list of rows: per row the cache segments it reads (one
    reference each, held by the row), the blocks to compute first, and the keys inserted for them
    (forgotten again if computing them fails)."""

    def __init__(self) -> None:
        self.shared: list[list[int]] = []
        self.blocks: list[PrefixBlock] = []
        self.inserted: list[bytes] = []
        self.tokens_computed = 0

    def discard(self, allocator: SegmentAllocator, cache: PrefixCache) -> None:
        """Give back the rows' references not handed on yet and forget the blocks never computed."""
        for segments in self.shared:
            allocator.release(segments)
        for key in self.inserted:
            cache.forget(key)
        self.shared, self.inserted = [], []


def share_prefixes(cache: PrefixCache, allocator: SegmentAllocator, segment_size: int,
                   prompts: list[list[int]], adapters: list[int] | None = None) -> SharedPrefixes | None:
    """Per row, the prefix-cache segments it can read instead of recomputing. A block is shared when
    it is already cached or when two rows of this batch start with it; the first time it is needed it
    is planned to be computed once (reading the blocks before it) and cached. Each row keeps at least
    one token of its own to prefill. None when no row shares anything. `adapters`: each row's LoRA
    adapter slot; a block's KV depends on the adapter, so rows share only within one adapter."""
    seg = segment_size
    adapters = adapters or [0] * len(prompts)
    keys = [block_keys(p, seg, len(p) - 1, a) for p, a in zip(prompts, adapters)]
    seen: dict[bytes, int] = {}
    for row in keys:
        for key in row:
            seen[key] = seen.get(key, 0) + 1
    found = SharedPrefixes()
    try:
        for prompt, row_keys, adapter in zip(prompts, keys, adapters):
            segments = cache.match(row_keys)
            found.shared.append(segments)
            for segment in segments:  # the row's reference, taken at once: eviction must not pick them
                allocator.share(segment)
            wanted = len(segments)
            while wanted < len(row_keys) and seen[row_keys[wanted]] > 1:
                wanted += 1
            new = cache.reserve(wanted - len(segments)) if wanted > len(segments) else None
            if new is None:
                continue
            start = len(segments) * seg
            table = tuple(s * seg + o for s in segments + new for o in range(seg))[: wanted * seg]
            tokens = tuple(prompt[start : wanted * seg])
            found.blocks.append(PrefixBlock(tokens, start, table, adapter))
            found.tokens_computed += len(tokens)
            for key, segment in zip(row_keys[len(segments) : wanted], new):
                cache.insert(key, segment)  # the reservation's reference becomes the cache's
                found.inserted.append(key)
                allocator.share(segment)
            segments.extend(new)
    except BaseException:
        found.discard(allocator, cache)
        raise
    if not any(found.shared):
        return None
    return found


class PagedLayout(Layout):
    def __init__(self, geometry: ArenaGeometry, allocator: SegmentAllocator, account: KVAccount, cache: PrefixCache,
                 trash_slot: int, found: SharedPrefixes) -> None:
        self.geometry, self.allocator, self.account, self.cache = geometry, allocator, account, cache
        self.trash_slot, self.found = trash_slot, found
        super().__init__()
        self.joining: list[Row] = []

    def joinable(self, queue: deque[Row]) -> int:
        return 0

    def before_refill(self, queue: deque[Row]) -> list[KVOp]:
        return []

    def admit(self, rows: list[Row]) -> tuple[list[KVOp], PagedPrefill]:
        g, allocator, seg = self.geometry, self.allocator, self.geometry.segment_size
        stripes = range(g.striped_segments)
        for row, shared in zip(rows, self.found.shared):
            row.shared = shared
        self.joining, self.found.shared = rows, []  # from here on the rows hold their references
        cached = [len(r.shared) * seg for r in rows]
        for row, c in zip(rows, cached):
            row.segments = allocator.allocate(g.segments_for(len(row.prompt) - c + row.params.max_new_tokens),
                                              within=stripes)
        unique_shared = len({s for r in rows for s in r.shared})
        self.account.kv(sum(len(r.segments) for r in rows) + unique_shared,
                        sum(g.segments_for(len(r.prompt) + r.params.max_new_tokens) for r in rows))
        tables = tuple(tuple(s * seg + o for s in r.shared + r.segments for o in range(seg)) for r in rows)
        prefill = PagedPrefill(tuple(NewRow(r.prompt, r.params, r.adapter) for r in rows), tables, tuple(cached),
                               self.trash_slot, tuple(self.found.blocks))
        self.account.cached_prompt_tokens(sum(cached))
        self.account.prefix_tokens(self.found.tokens_computed)
        return [], prefill

    def admitted(self, rows: list[Row], slots: list[int]) -> None:
        for row in rows:
            row.slots = row.position = len(row.prompt)
        self.rows, self.joining = list(rows), []
        self.found.inserted = []  # computed: the cache keeps them

    def decode(self) -> PagedDecode:
        return PagedDecode(tuple(r.position for r in self.rows))

    def drop(self, finished: list[int]) -> tuple[list[int], list[KVOp]]:
        for j in finished:  # a finished row gives its memory back at once
            row = self.rows[j]
            self.allocator.release(row.segments + row.shared)
            row.segments, row.shared = [], []
        return self._leave_in_place(finished), []

    def release(self) -> None:
        for row in self.rows + self.joining:
            self.allocator.release(row.segments + row.shared)
            row.segments, row.shared = [], []
        self.found.discard(self.allocator, self.cache)  # blocks planned but never computed: forgotten
        self.rows, self.joining = [], []
