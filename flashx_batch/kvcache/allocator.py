"""`SegmentAllocator`: integer bookkeeping over the arena's fixed-size segments (no tensors).

Reference counts exist so that prefix reuse can point several rows at one read-only segment.
"""

from __future__ import annotations


class ArenaFullError(RuntimeError):
    """More segments were requested than the arena has free (a scheduler bug, not a user error)."""


class SegmentAllocator:
    """Free list + reference counts over `num_segments` segments of `segment_size` slots."""

    def __init__(self, num_segments: int, segment_size: int) -> None:
        self.num_segments = num_segments
        self.segment_size = segment_size
        self.refcount = [0] * num_segments
        self._free = set(range(num_segments))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_in(self, region: range) -> int:
        """Free segments inside `region` (the stripes, or the prefix cache's reserve)."""
        return sum(1 for s in region if self.refcount[s] == 0)

    def segments_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.segment_size)

    def take(self, segment_ids: list[int]) -> list[int]:
        """Claim exactly these segments (static stripes); each must be free."""
        busy = [s for s in segment_ids if s not in self._free]
        if busy:
            raise ArenaFullError(f"segments {busy[:8]} are already in use")
        for s in segment_ids:
            self._free.discard(s)
            self.refcount[s] = 1
        return list(segment_ids)

    def allocate(self, count: int, within: range | None = None) -> list[int]:
        """Claim any `count` free segments (inside `within` if given), lowest ids first."""
        free = sorted(s for s in self._free if within is None or s in within)
        if count > len(free):
            raise ArenaFullError(f"need {count} segments, {len(free)} free of {self.num_segments}")
        return self.take(free[:count])

    def allocate_run(self, count: int, within: range) -> list[int] | None:
        """Claim `count` free segments in a row — the lowest-numbered such run inside `within` — or
        None when no run is that long (the free segments may still add up: see `free_in`)."""
        run = 0
        for s in within:
            run = run + 1 if s in self._free else 0
            if run == count:
                return self.take(list(range(s - count + 1, s + 1)))
        return None

    def share(self, segment_id: int) -> None:
        """Another row now reads this segment (prefix reuse)."""
        if self.refcount[segment_id] <= 0:
            raise ValueError(f"segment {segment_id} is not allocated")
        self.refcount[segment_id] += 1

    def release(self, segment_ids: list[int]) -> None:
        for s in segment_ids:
            if self.refcount[s] <= 0:
                raise ValueError(f"segment {s} released more often than taken")
            self.refcount[s] -= 1
            if self.refcount[s] == 0:
                self._free.add(s)

    def is_whole(self) -> bool:
        """True when every segment is free again: the check tests run after each batch."""
        return len(self._free) == self.num_segments and not any(self.refcount)
