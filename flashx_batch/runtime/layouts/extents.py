"""`ExtentLayout`: each row in one contiguous extent of the stripe region, sized to its own prompt +
new tokens (whole segments), instead of equal stripes cut for the longest row.

A row joins whenever the free segments hold its extent (up to batch_growth x the base rows), so a
long row still decoding no longer shortens what every other row may use — the decode steps a paged
cache would take, without a gather: attention reads each row's extent in place, one call per run of
rows (`extent_runs`). Extents are placed first-fit; when the free segments add up but no run of them
is long enough, the live rows are moved to the front of the region (`compact`: each live row's KV
copied once). Finished rows leave without moving anyone.
"""

from __future__ import annotations

import itertools
from collections import deque

from flashx_batch.kvcache.allocator import ArenaFullError, SegmentAllocator
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.runtime.layouts.base import Layout
from flashx_batch.runtime.plan import ExtentDecode, ExtentPrefill, KVOp, NewRow, SlotMove
from flashx_batch.runtime.results import KVAccount
from flashx_batch.runtime.rows import Row


def extent_runs(starts: list[int], sizes: list[int], lengths: list[int]
                ) -> tuple[tuple[int, int, int, int, int, bool], ...]:
    """How one decode step reads extents: runs of rows (first row, end row, first slot, stride, slots
    read, aligned). Rows admitted together whose extents are equally long and follow one another in
    the arena form one run, read as one strided view up to the run's longest row (`aligned`: every
    row that long, so no mask); any other row is a run of its own, read exactly to its length."""
    runs: list[tuple[int, int, int, int, int, bool]] = []
    a = 0
    for i in range(1, len(starts) + 1):
        if i < len(starts) and sizes[i] == sizes[a] and starts[i] == starts[i - 1] + sizes[a]:
            continue
        run = lengths[a:i]
        longest = max(run)
        runs.append((a, i, starts[a], sizes[a] if i - a > 1 else longest, longest, min(run) == longest))
        a = i
    return tuple(runs)


class ExtentLayout(Layout):
    def __init__(self, geometry: ArenaGeometry, allocator: SegmentAllocator, account: KVAccount, growth: int) -> None:
        if geometry.num_segments != geometry.striped_segments:  # `joinable` counts every free segment
            raise ValueError("extent batches need an arena of stripes only (no prefix cache, no spare segments)")
        self.geometry, self.allocator, self.account = geometry, allocator, account
        self.region = range(geometry.striped_segments)
        self.max_rows = geometry.base_rows * growth
        super().__init__()
        self.joining: list[Row] = []  # placed by `admit`, live from `admitted` on

    def joinable(self, queue: deque[Row]) -> int:
        """How many rows from the front of `queue` fit now, in order."""
        free, count = self.allocator.num_free, 0
        for row in itertools.islice(queue, self.max_rows - len(self.rows)):
            wanted = self.geometry.segments_for(row.need)
            if wanted > free:
                break
            free -= wanted
            count += 1
        return count

    def admit(self, rows: list[Row]) -> tuple[list[KVOp], ExtentPrefill]:
        """New extents for `rows` (packed into one prefill), compacting the live rows first when the
        free segments add up but are too scattered."""
        wanted = [self.geometry.segments_for(len(r.prompt) + r.params.max_new_tokens) for r in rows]
        ops: list[KVOp] = []
        extents = self._place(wanted)
        if extents is None:  # the free segments add up (`joinable`), but not in long enough runs
            ops = self.compact()
            extents = self._place(wanted)
            if extents is None:
                raise ArenaFullError(f"rows needing {wanted} segments do not fit the {self.allocator.num_free} "
                                     "free ones")
        seg = self.geometry.segment_size
        for row, extent in zip(rows, extents):
            row.segments = extent
        self.joining = rows
        joining = tuple(NewRow(r.prompt, r.params, r.adapter) for r in rows)
        return ops, ExtentPrefill(joining, tuple(e[0] * seg for e in extents))

    def admitted(self, rows: list[Row], slots: list[int]) -> None:
        for row in rows:
            row.slots = row.position = len(row.prompt)
            self.rows.append(row)
        self.joining = []
        held = sum(len(r.segments) for r in self.rows)
        self.account.kv(held, held)

    def before_refill(self, queue: deque[Row]) -> list[KVOp]:
        return []  # nothing to re-cut: every row has its own extent

    def _place(self, wanted: list[int]) -> list[list[int]] | None:
        """First-fit extents for `wanted` segments each, all or none."""
        taken = []
        for count in wanted:
            extent = self.allocator.allocate_run(count, self.region)
            if extent is None:
                for done in taken:
                    self.allocator.release(done)
                return None
            taken.append(extent)
        return taken

    def compact(self) -> list[KVOp]:
        """Move every live row's extent to the front of the region, in arena order, so the free
        segments become one run at the end (in arena order a row's new place never reaches a later
        row's old one)."""
        seg = self.geometry.segment_size
        order = sorted(self.rows, key=lambda r: r.segments[0])
        old = [r.segments[0] * seg for r in order]
        for row in order:
            self.allocator.release(row.segments)
        first = 0
        for row in order:
            count = len(row.segments)
            row.segments = self.allocator.take(list(range(first, first + count)))
            first += count
        self.account.relayout()
        return [SlotMove(src, row.segments[0] * seg, row.slots) for row, src in zip(order, old)]

    def decode(self) -> ExtentDecode:
        seg = self.geometry.segment_size
        starts = [r.segments[0] * seg for r in self.rows]
        runs = extent_runs(starts, [len(r.segments) * seg for r in self.rows], [r.slots + 1 for r in self.rows])
        return ExtentDecode(tuple(r.slots for r in self.rows), tuple(starts), runs)

    def drop(self, finished: list[int]) -> tuple[list[int], list[KVOp]]:
        for j in finished:
            self.allocator.release(self.rows[j].segments)
            self.rows[j].segments = []
        return self._leave_in_place(finished), []

    def release(self) -> None:
        for row in self.rows + self.joining:
            self.allocator.release(row.segments)
            row.segments = []
        self.rows, self.joining = [], []
