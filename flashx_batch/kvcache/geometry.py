"""`ArenaGeometry`: how the KV arena's slots divide into segments and stripes — plain integers.

slot = segment * segment_size + offset. The first `striped_segments` segments are the *stripe
region*, sized for `base_rows` rows of `base_capacity` slots; any segments after it hold the prefix
cache (and its trash segment) or a segment-sparse prefill's staging room.

The current *layout* cuts the stripe region into `max_rows` stripes of `row_capacity` slots: batch
position i owns stripe i, so a whole batch's cache is one strided view with no gather. A batch of
short rows is cut into more, shorter stripes of the same bytes (`layout_for`). Changing the layout
with rows in it is a scheduler decision: it emits the slot copies (`runtime.plan.SlotMove`) that the
runner applies to the arena.
"""

from __future__ import annotations


class ArenaGeometry:
    def __init__(self, segment_size: int, base_rows: int, base_capacity: int, extra_segments: int = 0) -> None:
        if base_capacity % segment_size:
            raise ValueError("row_capacity must be a multiple of segment_size")
        self.segment_size = segment_size
        self.base_rows, self.base_capacity = base_rows, base_capacity  # the layout the arena was sized for
        # the stripe region: fixed bytes, whatever layout cuts it (prefix cache / spare segments follow it)
        self.striped_slots = base_rows * base_capacity
        self.striped_segments = self.striped_slots // segment_size
        self.num_segments = self.striped_segments + extra_segments
        self.num_slots = self.num_segments * segment_size
        self.set_layout(base_capacity)

    def set_layout(self, row_capacity: int, max_rows: int | None = None) -> None:
        """Cut the stripe region into stripes of `row_capacity` slots: `max_rows` of them (default: as
        many as fit). Moves no data: with rows in the stripes, the caller plans the copies that move
        them to their new stripes (`runtime.layouts.stripes.restripe_ops`)."""
        fits = self.striped_slots // row_capacity if row_capacity > 0 else 0
        rows = fits if max_rows is None else max_rows
        if row_capacity % self.segment_size or not 1 <= rows <= fits:
            raise ValueError(f"a layout of {rows} stripes x {row_capacity} slots does not cut a stripe region of "
                             f"{self.striped_slots} slots in {self.segment_size}-slot segments")
        self.max_rows, self.row_capacity = rows, row_capacity
        self.segments_per_row = row_capacity // self.segment_size

    def reset_layout(self) -> None:
        self.set_layout(self.base_capacity, self.base_rows)

    def stripe_segments(self, row: int) -> list[int]:
        start = row * self.segments_per_row
        return list(range(start, start + self.segments_per_row))

    def segments_for(self, slots: int) -> int:
        return -(-slots // self.segment_size)

    def layout_for(self, slots: int, growth: int) -> tuple[int, int]:
        """(stripe capacity, rows) for rows of at most `slots` KV slots each: as many rows as the stripe
        region holds, at most growth x the base rows, each stripe as long as that leaves it (the slack
        lets slightly longer rows, with more new tokens, join later without a re-cut)."""
        seg = self.segment_size
        need = max(seg, -(-slots // seg) * seg)
        rows = max(1, min(self.base_rows * growth, self.striped_slots // need))
        return (self.striped_slots // rows) // seg * seg, rows
