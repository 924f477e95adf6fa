"""KV arena and its bookkeeping: one allocation, segment tables, reference counts, stripes, KV copies."""

import pytest
import torch

from flashx_batch.backends.cpu import onednn_packs
from flashx_batch.kvcache.allocator import ArenaFullError, SegmentAllocator
from flashx_batch.kvcache.arena import KVArena
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.kvcache.spec import LayerCache
from flashx_batch.runtime.layouts.stripes import StripeLayout, restripe_ops
from flashx_batch.runtime.params import SamplingParams
from flashx_batch.runtime.plan import ClearBias, SlotMove
from flashx_batch.runtime.results import GenerateStats, KVAccount
from flashx_batch.runtime.rows import Row


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


def _arena(num_slots: int, layers: int = 2, heads: int = 1, dim: int = 2) -> KVArena:
    return KVArena((LayerCache("kv", 2, heads, dim),) * layers, num_slots=num_slots, dtype=torch.float32,
                   device=torch.device("cpu"))


def _apply(arena: KVArena, ops) -> None:
    """What the torch runner does with a plan's KV ops."""
    for op in ops:
        if isinstance(op, SlotMove):
            arena.move_slots([(op.src, op.dst, op.n)])
        else:
            arena.clear_bias(op.start, op.end)


def test_move_slots_copies_runs_down_even_onto_themselves():
    arena = _arena(32)
    arena.storage.copy_(torch.arange(arena.storage.numel(), dtype=torch.float32).view_as(arena.storage))
    arena.bias.copy_(torch.arange(32, dtype=torch.float32))
    before, bias = arena.storage.clone(), arena.bias.clone()
    arena.move_slots([(4, 0, 6), (20, 8, 5)])  # overlaps its own old place; then one that does not
    assert torch.equal(arena.storage[:, :, 0:6], before[:, :, 4:10]) and torch.equal(arena.bias[0:6], bias[4:10])
    assert torch.equal(arena.storage[:, :, 8:13], before[:, :, 20:25]) and torch.equal(arena.bias[8:13], bias[20:25])
    assert torch.equal(arena.storage[:, :, 13:], before[:, :, 13:])  # nothing else written


def test_layer_views_are_views_and_moves_copy_every_layer():
    geometry = ArenaGeometry(segment_size=4, base_rows=4, base_capacity=8)
    arena = _arena(geometry.num_slots, layers=3, heads=2, dim=4)
    assert geometry.num_segments == 8 and arena.nbytes == 3 * 2 * 32 * 2 * 4 * 4
    k, v = arena.layer_views()[1]
    assert k.data_ptr() == arena.storage[1, 0].data_ptr()  # a view, no copy
    k[24:29] = 7.0  # stripe 3 of 8 slots
    v[24:29] = 9.0
    arena.move_slots([(3 * 8, 0, 5)])
    assert torch.all(k[:5] == 7.0) and torch.all(v[:5] == 9.0) and torch.all(k[5:8] == 0)
    assert geometry.stripe_segments(2) == [4, 5]


def test_restriping_moves_each_row_to_its_stripe_in_the_new_layout():
    """Re-cutting the stripes with rows in them: each row's slots (keys, values, merge bias, every
    layer) land at the start of its stripe in the new layout, shrinking and growing back; nothing
    else is left behind in the bias."""
    geometry = ArenaGeometry(segment_size=4, base_rows=3, base_capacity=16)
    arena = _arena(geometry.num_slots)
    lengths = [7, 3, 5]  # three rows: growing back, row 1's new place is row 2's old one (order matters)
    for row, n in enumerate(lengths):
        arena.storage[:, :, row * 16 : row * 16 + n] = torch.arange(n, dtype=torch.float32)[:, None, None] + 10 * row
        arena.bias[row * 16 : row * 16 + n] = row + 1.0
    expected = [arena.storage[:, :, row * 16 : row * 16 + n].clone() for row, n in enumerate(lengths)]
    old = 16
    for capacity, rows in ((8, 6), (16, 3)):
        geometry.set_layout(capacity, rows)
        assert (geometry.max_rows, geometry.row_capacity, geometry.segments_per_row) == (rows, capacity, capacity // 4)
        _apply(arena, restripe_ops(lengths, old, capacity, geometry.striped_slots))
        for row, n in enumerate(lengths):
            assert torch.equal(arena.storage[:, :, row * capacity : row * capacity + n], expected[row])
            assert torch.all(arena.stripe_bias(rows, capacity)[row, :n] == row + 1.0)
        assert arena.bias.sum() == 7 * 1.0 + 3 * 2.0 + 5 * 3.0
        old = capacity
    with pytest.raises(ValueError, match="does not cut"):
        geometry.set_layout(10)  # not whole segments
    with pytest.raises(ValueError, match="does not cut"):
        geometry.set_layout(8, 7)  # 7 stripes of 8 do not fit 48 slots


def test_finished_rows_leave_stripes_dense_and_the_allocator_whole():
    """A stripe batch: the last live row moves into a finished row's stripe (its KV copied, the rest of
    the stripe's bias cleared); the order of the runner's live state follows `keep`."""
    geometry = ArenaGeometry(segment_size=4, base_rows=4, base_capacity=8)
    allocator = SegmentAllocator(geometry.num_segments, geometry.segment_size)
    stats = GenerateStats()
    layout = StripeLayout(geometry, allocator, KVAccount(stats, 64), 1, None, 16, None)
    rows = [Row(i, [1] * n, SamplingParams(max_new_tokens=2), n + 2) for i, n in enumerate((5, 3, 6, 2))]
    ops, prefill = layout.admit(rows)
    assert ops == [ClearBias(0, geometry.num_slots)] and prefill.first == 0 and prefill.capacity == 8
    layout.admitted(rows, [5, 3, 6, 2])
    assert stats.kv_bytes_peak == 64 * 7  # slots + new tokens, in whole 4-slot segments: 2 + 2 + 2 + 1
    keep, ops = layout.drop([0, 2])
    assert keep == [3, 1] and [r.index for r in layout.rows] == [3, 1]
    # the last row fills the highest hole first, then moves again into the lowest
    assert ops == [SlotMove(24, 16, 2), ClearBias(18, 24), SlotMove(16, 0, 2), ClearBias(2, 8)]
    assert layout.decode().positions == (2, 3)
    layout.release()
    assert allocator.is_whole()


@pytest.mark.skipif(not onednn_packs(torch.float32), reason="no oneDNN linear in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_plain_matmul_for_any_rows(dtype):
    """One oneDNN-packed weight serves every row count and shape (2-D, 3-D, none, a strided view): each
    gives F.linear's values to rounding, and a row's output does not depend on the rows beside it
    beyond the last bits."""
    from flashx_batch.models.layers import Linear

    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    torch.manual_seed(0)
    layer = Linear(24, 16, True, dtype, torch.device("cpu"))
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.pack()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    for shape in ((1, 16), (3, 16), (8, 16), (11, 16), (300, 16), (6, 1, 16), (2, 3, 16), (0, 16)):
        x = torch.randn(shape).to(dtype)
        out = layer.forward(x)
        assert out.shape == (*shape[:-1], 24) and out.dtype == dtype
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), **tol)
    wide = torch.randn(5, 32).to(dtype)
    strided = wide[:, ::2]
    torch.testing.assert_close(layer.forward(strided), torch.nn.functional.linear(strided, layer.weight, layer.bias),
                               **tol)
    rows = torch.randn(9, 16).to(dtype)
    torch.testing.assert_close(layer.forward(rows[:1]), layer.forward(rows)[:1], **tol)
