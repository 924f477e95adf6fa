"""The KV arena: one allocation at engine start, divided into fixed segments.

Two owners, as in nano-vllm:
- `SegmentAllocator` is integer bookkeeping only (free list, reference counts, per-row segment
  tables). Reference counts exist so that prefix reuse can point several rows at one read-only
  segment; a row's table may also hold fewer slots than tokens once KV merging lands.
- `KVArena` owns the tensor `[layers, 2, slots, kv_heads, head_dim]`, where slot = segment *
  segment_size + offset. Nothing here allocates per decode step.

Static batching uses *stripes*: batch position i owns segments [i*S, (i+1)*S), so a whole batch's
cache is a strided view `[B, cap, kv_heads, head_dim]` with no gather. The stripe region is sized for
`max_batch_size` rows of full length; its *layout* (stripe capacity, and so how many stripes) can be
changed between batches or mid-batch (`set_layout`, `relayout`): a bucket of short rows is cut into
more, shorter stripes of the same bytes. Rows whose tables are not
stripes (shared prefixes, merged rows) will need a gather of their slots; the slot arithmetic
(segment * segment_size + offset) is already the addressing scheme, so that is a read path to add,
not a re-layout.
"""

from __future__ import annotations

import torch


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


class KVArena:
    """Device storage for keys and values of every layer, allocated once."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_rows: int,
                 row_capacity: int, segment_size: int, dtype: torch.dtype, device: torch.device,
                 extra_segments: int = 0) -> None:
        """`extra_segments` after the last stripe give a segment-sparse prefill room to hold the
        last row's uncompressed prompt before it is merged down into its stripe."""
        if row_capacity % segment_size:
            raise ValueError("row_capacity must be a multiple of segment_size")
        self.segment_size = segment_size
        self.base_rows, self.base_capacity = max_rows, row_capacity  # the layout the arena was sized for
        # the stripe region: fixed bytes, whatever layout cuts it (prefix cache / spare segments follow it)
        self.striped_slots = max_rows * row_capacity
        self.striped_segments = self.striped_slots // segment_size  # segments 0.. these: stripes, then the rest
        self.num_segments = self.striped_segments + extra_segments
        self.num_slots = self.num_segments * segment_size
        self.storage = torch.zeros(num_layers, 2, self.num_slots, num_kv_heads, head_dim, dtype=dtype,
                                   device=device)
        # log(tokens a slot stands for): 0 for an ordinary slot, log 4 for a 4:1 merged one.
        self.bias = torch.zeros(self.num_slots, dtype=torch.float32, device=device)
        self.allocator = SegmentAllocator(self.num_segments, segment_size)
        # per-layer views, built once: slicing the storage anew costs every layer of every step
        self._flat = [(self.storage[layer, 0], self.storage[layer, 1]) for layer in range(num_layers)]
        self._layouts: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = {}
        self.set_layout(row_capacity)

    def set_layout(self, row_capacity: int, max_rows: int | None = None) -> None:
        """Cut the stripe region into stripes of `row_capacity` slots: `max_rows` of them (default:
        as many as fit). Moves no data: call it with no row in the stripes, or use `relayout`."""
        fits = self.striped_slots // row_capacity if row_capacity > 0 else 0
        rows = fits if max_rows is None else max_rows
        if row_capacity % self.segment_size or not 1 <= rows <= fits:
            raise ValueError(f"a layout of {rows} stripes x {row_capacity} slots does not cut a stripe region of "
                             f"{self.striped_slots} slots in {self.segment_size}-slot segments")
        self.max_rows, self.row_capacity = rows, row_capacity
        self.segments_per_row = row_capacity // self.segment_size
        if row_capacity not in self._layouts:  # views per capacity, built once (a job reuses few layouts)
            fits_slots = fits * row_capacity
            shape = (fits, row_capacity, *self.storage.shape[3:])
            views = [(k[:fits_slots].view(shape), v[:fits_slots].view(shape)) for k, v in self._flat]
            starts = torch.arange(fits, device=self.storage.device) * row_capacity
            self._layouts[row_capacity] = (views, starts)
        self._stripes, self._stripe_starts = self._layouts[row_capacity]

    def relayout(self, lengths: list[int], row_capacity: int, max_rows: int | None = None) -> None:
        """Switch layouts with rows in the stripes: stripe i's first `lengths[i]` slots (keys, values
        and merge bias) move to stripe i of the new layout; every length must fit the new capacity."""
        if any(n > row_capacity for n in lengths):
            raise ValueError(f"rows of {max(lengths)} slots do not fit stripes of {row_capacity}")
        old = self.row_capacity
        self.set_layout(row_capacity, max_rows)
        if len(lengths) > self.max_rows:
            raise ValueError(f"{len(lengths)} rows do not fit a layout of {self.max_rows} stripes")
        moves = [(i * old, i * row_capacity, n) for i, n in enumerate(lengths)]
        # shorter stripes: every row moves towards the front, so in row order no destination reaches a
        # later row's source; longer ones: the same in reverse order (`move_slots` copies a run that
        # overlaps its own old place out first)
        self.move_slots(moves if row_capacity <= old else moves[::-1])
        for i, n in enumerate(lengths):  # no bias left behind where the rows' next tokens go
            self.bias[i * row_capacity + n : (i + 1) * row_capacity] = 0.0
        self.bias[len(lengths) * row_capacity : self.striped_slots] = 0.0

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def bytes_per_token(self) -> int:
        return self.nbytes // self.num_slots

    def layer_slot_bytes(self) -> int:
        """Bytes of one slot's keys and values in one layer (what attention reads per slot and layer)."""
        return self.bytes_per_token() // self.storage.shape[0]

    def stripe_segments(self, row: int) -> list[int]:
        start = row * self.segments_per_row
        return list(range(start, start + self.segments_per_row))

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[slots, kv_heads, head_dim] views of one layer's keys and values."""
        return self._flat[layer]

    def stripes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, cap, kv_heads, head_dim] views of the current layout (rows >= max_rows): batch
        position i is stripe i."""
        return self._stripes[layer]

    def stripe_starts(self) -> torch.Tensor:
        """[rows] flat slot where each stripe of the current layout begins."""
        return self._stripe_starts

    def stripe_bias(self) -> torch.Tensor:
        """[max_rows, cap] log-count bias per slot, same striping as `stripes`."""
        used = self.max_rows * self.row_capacity
        return self.bias[:used].view(self.max_rows, self.row_capacity)

    def move_slots(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy each (src, dst, n) run of flat slots — keys, values and merge bias, all layers — in
        order. A run that overlaps its own destination is copied out first; the caller orders the
        moves so that no destination overwrites a source still to come."""
        for src, dst, n in moves:
            if src == dst:
                continue
            overlaps = dst < src + n and src < dst + n
            kv, bias = self.storage[:, :, src : src + n], self.bias[src : src + n]
            self.storage[:, :, dst : dst + n] = kv.clone() if overlaps else kv
            self.bias[dst : dst + n] = bias.clone() if overlaps else bias

    def move_stripe(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` slots of stripe `src` into stripe `dst`, all layers at once.

        Used when a row finishes: the last active row moves into its place so the active rows
        stay a dense prefix of the stripes and finished rows cost no more compute.
        """
        cap = self.row_capacity
        self.move_slots([(src * cap, dst * cap, length)])
        # the slots the moved row writes next must not keep the old row's bias
        self.bias[dst * cap + length : (dst + 1) * cap] = 0.0
