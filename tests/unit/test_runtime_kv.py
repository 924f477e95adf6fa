"""KV arena bookkeeping: one allocation, segment tables, reference counts, stripes."""

import pytest
import torch

from flashx_batch.runtime.kv import ArenaFullError, KVArena, SegmentAllocator


def test_allocator_refcounts_and_wholeness():
    alloc = SegmentAllocator(num_segments=6, segment_size=4)
    a = alloc.allocate(2)
    b = alloc.take([4, 5])
    assert alloc.num_free == 2 and alloc.segments_for(9) == 3
    alloc.share(a[0])  # a second row reads the same prefix segment
    alloc.release(a)
    assert alloc.refcount[a[0]] == 1 and not alloc.is_whole()
    alloc.release([a[0]])
    alloc.release(b)
    assert alloc.is_whole()
    with pytest.raises(ValueError):
        alloc.release([0])
    with pytest.raises(ArenaFullError):
        alloc.allocate(7)
    alloc.take([1])
    with pytest.raises(ArenaFullError):
        alloc.take([1])


def test_arena_stripes_are_views_and_move_copies_all_layers():
    arena = KVArena(num_layers=3, num_kv_heads=2, head_dim=4, max_rows=4, row_capacity=8, segment_size=4,
                    dtype=torch.float32, device=torch.device("cpu"))
    assert arena.num_segments == 8 and arena.nbytes == 3 * 2 * 32 * 2 * 4 * 4
    k, v = arena.stripes(1)
    assert k.data_ptr() == arena.storage[1, 0].data_ptr()  # a view, no copy
    k[3, :5] = 7.0
    v[3, :5] = 9.0
    arena.move_stripe(3, 0, 5)
    k0, v0 = arena.stripes(1)
    assert torch.all(k0[0, :5] == 7.0) and torch.all(v0[0, :5] == 9.0) and torch.all(k0[0, 5:] == 0)
    assert arena.stripe_segments(2) == [4, 5]
