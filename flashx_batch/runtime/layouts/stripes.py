"""`StripeLayout`: row i of the batch lives in stripe i of the arena's stripe region.

Attention reads the stripes as one strided view; a finished row's stripe is refilled by the last
active row so the active rows stay a dense prefix, and new rows are admitted after them. A growing
batch (`longest_from`) re-cuts the stripes shorter whenever the rows left and every queued row fit
shorter stripes that add at least a quarter more rows (one copy of the live KV).
"""

from __future__ import annotations

from collections import deque

from flashx_batch.kvcache.allocator import ArenaFullError, SegmentAllocator
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.runtime.layouts.base import Layout
from flashx_batch.runtime.plan import ClearBias, KVOp, NewRow, SlotMove, StripeDecode, StripePrefill
from flashx_batch.runtime.results import KVAccount
from flashx_batch.runtime.rows import Row

# a mid-batch re-cut of the stripes must add at least this share of rows (each re-cut copies the live KV)
REGRID_GAIN = 0.25


def attention_groups(lengths: list[int], bytes_per_slot: int, min_bytes: int | None
                     ) -> tuple[tuple[int, int, int], ...] | None:
    """How one decode step's attention reads the stripes: None for one call over every row up to
    the longest row's `lengths` (visible slots per row, in stripe order), else two contiguous runs
    of rows (start, end, visible slots), each read only up to its own longest row.

    Masked slots past a row's end are read all the same by one call; rows of mixed lengths (the
    rows a refill brings in are shorter than those already decoding) can waste a third of those
    reads. The cut is the one that reads least, taken when it saves at least `min_bytes` of one
    layer's cache (`bytes_per_slot`: keys + values of one slot of one layer; the backend's
    `attention_split_min_bytes`, None: never split). Each row attends to its own slots either
    way: logits equal up to float rounding (SDPA blocks the keys differently), tokens equal in
    the tests."""
    n = len(lengths)
    if n < 2 or min_bytes is None:
        return None
    suffix = lengths[:]
    for i in range(n - 2, -1, -1):
        suffix[i] = max(suffix[i], suffix[i + 1])
    whole, best, cut, head = n * suffix[0], n * suffix[0], 0, 0
    for k in range(1, n):
        head = max(head, lengths[k - 1])
        reads = k * head + (n - k) * suffix[k]
        if reads < best:
            best, cut = reads, k
    if best == whole or (whole - best) * bytes_per_slot < min_bytes:
        return None
    return (0, cut, max(lengths[:cut])), (cut, n, suffix[cut])


def restripe_ops(lengths: list[int], old: int, new: int, striped_slots: int) -> list[KVOp]:
    """The KV copies that move stripe i's first `lengths[i]` slots from a layout of `old`-slot stripes
    to stripe i of `new`-slot stripes, then clear the merge bias wherever the rows' next tokens (or new
    rows) will go. Shorter stripes: every row moves towards the front, so in row order no destination
    reaches a later row's source; longer ones: the same in reverse order (a run overlapping its own
    old place is copied out first by the arena)."""
    moves: list[KVOp] = [SlotMove(i * old, i * new, n) for i, n in enumerate(lengths)]
    ops = moves if new <= old else moves[::-1]
    ops += [ClearBias(i * new + n, (i + 1) * new) for i, n in enumerate(lengths)]
    ops.append(ClearBias(len(lengths) * new, striped_slots))
    return ops


class StripeLayout(Layout):
    def __init__(self, geometry: ArenaGeometry, allocator: SegmentAllocator, account: KVAccount, growth: int,
                 longest_from: dict[int, int] | None, layer_slot_bytes: int, split_min_bytes: int | None) -> None:
        # longest_from: growing batches only, row index -> the most KV slots any row from it to the end
        # of the queue will hold (`before_refill` re-cuts no shorter, so no queued row ever waits for room)
        self.geometry, self.allocator, self.account, self.growth = geometry, allocator, account, growth
        self.longest_from = longest_from
        self.layer_slot_bytes, self.split_min_bytes = layer_slot_bytes, split_min_bytes
        super().__init__()
        self.merged = False  # some row's slots and positions parted ways: steps name each row's write slot

    def joinable(self, queue: deque[Row]) -> int:
        return min(self.geometry.max_rows - len(self.rows), len(queue))

    def admit(self, rows: list[Row]) -> tuple[list[KVOp], StripePrefill]:
        """Rows into the first free stripes. The batch's first rows start from a clean merge bias;
        later ones clear their stripes' (a previous occupant may have left merged slots there)."""
        g = self.geometry
        first, cap = len(self.rows), g.row_capacity
        clear = ClearBias(0, g.num_slots) if not self.rows else ClearBias(first * cap, (first + len(rows)) * cap)
        return [clear], StripePrefill(tuple(NewRow(r.prompt, r.params, r.adapter) for r in rows), first, cap)

    def admitted(self, rows: list[Row], slots: list[int]) -> None:
        for row, n in zip(rows, slots):
            row.slots, row.position = n, len(row.prompt)
            self.merged = self.merged or n != row.position
            row.segments = self._take_stripe(len(self.rows), self.geometry.segments_for(n + row.params.max_new_tokens))
            row.static_segments = self.geometry.segments_for(len(row.prompt) + row.params.max_new_tokens)
            self.rows.append(row)
        self.account.kv(sum(len(r.segments) for r in self.rows), sum(r.static_segments for r in self.rows))

    def before_refill(self, queue: deque[Row]) -> list[KVOp]:
        if self.longest_from is None:
            return []
        return self.regrid(self.longest_from[queue[0].index])

    def regrid(self, next_slots: int) -> list[KVOp]:
        """When the rows still decoding and every queued row (at most `next_slots` KV slots at its end)
        fit shorter stripes that make room for at least a quarter more rows, re-cut the stripe region
        that way, moving the live rows' KV (one copy of it; cheaper than the decode steps the extra rows
        save). Positions and slot counts do not change, only where stripes start."""
        g = self.geometry
        longest = max([len(r.segments) * g.segment_size for r in self.rows] + [next_slots])
        capacity, count = g.layout_for(longest, self.growth)
        if count < g.max_rows + max(1, int(g.max_rows * REGRID_GAIN)):
            return []
        old = g.row_capacity
        if any(r.slots > capacity for r in self.rows) or len(self.rows) > count:
            raise ValueError(f"{len(self.rows)} rows do not fit a layout of {count} stripes x {capacity}")
        g.set_layout(capacity, count)
        ops = restripe_ops([r.slots for r in self.rows], old, capacity, g.striped_slots)
        for row in self.rows:
            self.allocator.release(row.segments)
        for j, row in enumerate(self.rows):
            row.segments = self._take_stripe(j, len(row.segments))
        self.account.relayout()
        return ops

    def decode(self) -> StripeDecode:
        slots = [r.slots for r in self.rows]
        longest = max(slots)
        groups = attention_groups([n + 1 for n in slots], self.layer_slot_bytes, self.split_min_bytes)
        return StripeDecode(tuple(r.position for r in self.rows), tuple(slots) if self.merged else None,
                            longest + 1, min(slots) == longest, groups, self.geometry.row_capacity,
                            self.geometry.max_rows)

    def drop(self, finished: list[int]) -> tuple[list[int], list[KVOp]]:
        """Free finished positions; the last active rows move into the holes (their KV copied, the
        rest of the stripe's bias cleared). A moved row re-takes as many segments in its new stripe."""
        cap, ops = self.geometry.row_capacity, []
        old_of = list(range(len(self.rows)))
        for j in sorted(finished, reverse=True):
            last = len(self.rows) - 1
            self.allocator.release(self.rows[j].segments)
            if j != last:
                moved = self.rows[last]
                ops += [SlotMove(last * cap, j * cap, moved.slots), ClearBias(j * cap + moved.slots, (j + 1) * cap)]
                self.allocator.release(moved.segments)
                moved.segments = self._take_stripe(j, len(moved.segments))
                self.rows[j], old_of[j] = moved, old_of[last]
            self.rows.pop()
            old_of.pop()
        return old_of, ops

    def release(self) -> None:
        self.geometry.reset_layout()  # the next batch starts whole
        for row in self.rows:
            self.allocator.release(row.segments)
            row.segments = []
        self.rows = []

    def _take_stripe(self, row: int, segments: int) -> list[int]:
        """The first `segments` segments of stripe `row` in the current layout, refusing more than a
        stripe holds (a row must never write into the next stripe)."""
        if segments > self.geometry.segments_per_row:
            raise ArenaFullError(f"row {row} needs {segments} segments, its stripe holds "
                                 f"{self.geometry.segments_per_row}")
        return self.allocator.take(self.geometry.stripe_segments(row)[:segments])
