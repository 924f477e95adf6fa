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


def test_allocate_run_takes_the_first_long_enough_run_of_free_segments():
    alloc = SegmentAllocator(12, 16)
    alloc.take([2, 5, 6])  # free runs: 0-1, 3-4, 7-11
    assert alloc.allocate_run(2, range(12)) == [0, 1]
    assert alloc.allocate_run(3, range(12)) == [7, 8, 9]
    assert alloc.allocate_run(3, range(12)) is None  # 3-4 and 10-11 are free, but no 3 in a row
    assert alloc.allocate_run(2, range(0, 10)) == [3, 4]  # only inside `within`
    assert alloc.allocate_run(1, range(0, 10)) is None and alloc.num_free == 2


def test_move_slots_copies_runs_down_even_onto_themselves():
    arena = KVArena(num_layers=2, num_kv_heads=1, head_dim=2, max_rows=2, row_capacity=16, segment_size=16,
                    dtype=torch.float32, device=torch.device("cpu"))
    arena.storage.copy_(torch.arange(arena.storage.numel(), dtype=torch.float32).view_as(arena.storage))
    arena.bias.copy_(torch.arange(32, dtype=torch.float32))
    before, bias = arena.storage.clone(), arena.bias.clone()
    arena.move_slots([(4, 0, 6), (20, 8, 5)])  # overlaps its own old place; then one that does not
    assert torch.equal(arena.storage[:, :, 0:6], before[:, :, 4:10]) and torch.equal(arena.bias[0:6], bias[4:10])
    assert torch.equal(arena.storage[:, :, 8:13], before[:, :, 20:25]) and torch.equal(arena.bias[8:13], bias[20:25])
    assert torch.equal(arena.storage[:, :, 13:], before[:, :, 13:])  # nothing else written


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


def test_relayout_moves_each_row_to_its_stripe_in_the_new_layout():
    """Re-cutting the stripes with rows in them: each row's slots (keys, values, merge bias, every
    layer) land at the start of its stripe in the new layout, shrinking and growing back; nothing
    else is left behind in the bias."""
    arena = KVArena(num_layers=2, num_kv_heads=1, head_dim=2, max_rows=3, row_capacity=16, segment_size=4,
                    dtype=torch.float32, device=torch.device("cpu"))
    lengths = [7, 3, 5]  # three rows: growing back, row 1's new place is row 2's old one (order matters)
    for row, n in enumerate(lengths):
        arena.storage[:, :, row * 16 : row * 16 + n] = torch.arange(n, dtype=torch.float32)[:, None, None] + 10 * row
        arena.bias[row * 16 : row * 16 + n] = row + 1.0
    expected = [arena.storage[:, :, row * 16 : row * 16 + n].clone() for row, n in enumerate(lengths)]
    for capacity, rows in ((8, 6), (16, 3)):
        arena.relayout(lengths, capacity, rows)
        assert (arena.max_rows, arena.row_capacity, arena.segments_per_row) == (rows, capacity, capacity // 4)
        keys, _ = arena.stripes(1)
        for row, n in enumerate(lengths):
            assert torch.equal(arena.storage[:, :, row * capacity : row * capacity + n], expected[row])
            assert torch.equal(keys[row, :n], expected[row][1, 0])
            assert torch.all(arena.stripe_bias()[row, :n] == row + 1.0)
        assert arena.bias.sum() == 7 * 1.0 + 3 * 2.0 + 5 * 3.0
        assert arena.stripe_starts().tolist()[:rows] == [capacity * r for r in range(rows)]
    with pytest.raises(ValueError, match="do not fit"):
        arena.relayout([9, 3], 8, 6)
    with pytest.raises(ValueError, match="does not cut"):
        arena.set_layout(10)  # not whole segments


@pytest.mark.skipif(not hasattr(torch.ops.mkl, "_mkl_linear") or not torch.backends.mkl.is_available(),
                    reason="no MKL packed sgemm in this torch build")
def test_packed_linear_pads_between_sizes_and_matches_plain_matmul():
    """Weights packed for 4 and 8 rows: 4 or 8 rows run packed, 5-7 are padded up to 8, fewer than 4 and
    more than 8 run plain sgemm; every shape (2-D, 3-D) gives F.linear's values to rounding."""
    from flashx_batch.models.layers import Linear

    torch.manual_seed(0)
    layer = Linear(24, 16, True, torch.float32, torch.device("cpu"))
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.prepack([8, 4])
    assert sorted(layer.packed) == [4, 8] and layer._pack_for[1:9] == [0, 0, 0, 4, 8, 8, 8, 8]
    for shape in ((1, 16), (3, 16), (4, 16), (6, 16), (8, 16), (11, 16), (6, 1, 16), (2, 3, 16)):
        x = torch.randn(shape)
        out = layer.forward(x)
        assert out.shape == (*shape[:-1], 24)
        assert torch.allclose(out, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5), shape
