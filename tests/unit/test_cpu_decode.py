"""The CPU decode-attention kernel against torch's attention on the layouts the arena hands it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from flashx_batch.backends import cpu_decode


def _stripes(dtype, rows=5, cap=40, heads=3, dim=64, slots=33, seed=0):
    """Keys and values as a stripe decode sees them: [rows, Hkv, slots, D] views of [rows, cap, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    store = torch.randn(2, rows, cap, heads, dim, generator=g).to(dtype)
    return store[0, :, :slots].transpose(1, 2), store[1, :, :slots].transpose(1, 2)


def _reference(q, keys, values, mask, scale):
    return F.scaled_dot_product_attention(q.float(), keys.float(), values.float(),
                                          attn_mask=None if mask is None else mask.float(), scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_the_kernel_matches_torch_attention_with_and_without_a_mask(dtype, group):
    keys, values = _stripes(dtype)
    rows, heads, slots, dim = keys.shape
    q = torch.randn(rows, heads, group, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    mask = torch.zeros(rows, 1, 1, slots, dtype=dtype)
    mask[1, ..., 20:] = float("-inf")  # a shorter row of the run
    mask[2, ..., 3:7] = 1.386  # merged slots' log-count bias
    assert cpu_decode.usable(keys, values)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the output is rounded once
    for m in (None, mask):
        out = cpu_decode.attend(q, keys, values, m, dim ** -0.5)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), _reference(q, keys, values, m, dim ** -0.5),
                                   atol=tolerance, rtol=tolerance)


def test_boolean_and_broadcast_masks_read_as_torch_reads_them():
    """Paged decode hands a boolean mask (True: attend); a mask may also be one row for the whole batch."""
    keys, values = _stripes(torch.float32)
    rows, heads, slots, dim = keys.shape
    q = torch.randn(rows, heads, 2, dim, generator=torch.Generator().manual_seed(2))
    visible = torch.arange(slots + 4)[None, None, None, :] <= torch.tensor([32, 9, 20, 0, 15])[:, None, None, None]
    shared = torch.zeros(1, 1, 1, slots)
    shared[..., 5:] = float("-inf")
    for mask in (visible, shared):
        expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[..., :slots], scale=0.125)
        torch.testing.assert_close(cpu_decode.attend(q, keys, values, mask, 0.125), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_batch_is_read_through_its_slot_table(dtype):
    """Rows whose slots lie anywhere in the flat cache (shared prefix pages, a trash slot for padding)
    read as torch reads the same slots gathered; a table that is not one row per query, or that points
    outside the cache, is refused."""
    g = torch.Generator().manual_seed(6)
    flat_k, flat_v = (torch.randn(90, 2, 64, generator=g).to(dtype) for _ in range(2))
    rows, slots = 3, 24
    table = torch.randperm(89, generator=g)[: rows * slots].view(rows, slots)
    table[0, :8] = table[1, :8]  # a shared prefix page
    table[2, 20:] = 89  # padding: the trash slot, masked
    visible = torch.ones(rows, 1, 1, slots, dtype=torch.bool)
    visible[2, ..., 20:] = False
    q = torch.randn(rows, 2, 2, 64, generator=g).to(dtype)
    assert cpu_decode.usable_paged(flat_k, flat_v)
    out = cpu_decode.attend_paged(q, flat_k, flat_v, table, visible, 0.125)
    expected = F.scaled_dot_product_attention(q.float(), flat_k[table].transpose(1, 2).float(),
                                              flat_v[table].transpose(1, 2).float(), attn_mask=visible, scale=0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    with pytest.raises(ValueError, match="does not match"):
        cpu_decode.attend_paged(q, flat_k, flat_v, table[:2], visible, 0.125)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_decode.attend_paged(q, flat_k, flat_v, table + 10, visible, 0.125)
    assert not cpu_decode.usable_paged(flat_k[:, :, :32].to(torch.bfloat16), flat_v[:, :, :32].to(torch.bfloat16))
    assert not cpu_decode.usable_paged(flat_k.transpose(0, 1), flat_v.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_in_extents_are_read_each_to_its_own_length(dtype):
    """Rows whose slots follow one another from their own first slot (extents), each of its own
    length, in one call: as torch reads each row's slots alone; the row ending at the cache's last slot
    reads nothing past it; starts or lengths that do not match the rows, read no slot, or reach outside
    the cache are refused."""
    g = torch.Generator().manual_seed(9)
    flat_k, flat_v = (torch.randn(100, 2, 64, generator=g).to(dtype) for _ in range(2))
    starts, lengths = torch.tensor([0, 40, 17, 70]), torch.tensor([12, 25, 1, 30])  # the last row ends at 100
    q = torch.randn(4, 2, 2, 64, generator=g).to(dtype)
    out = cpu_decode.attend_rows(q, flat_k, flat_v, cpu_decode.row_extents(starts, lengths), 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for r, (a, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        keys, values = (t[a : a + n].transpose(0, 1)[None].float() for t in (flat_k, flat_v))
        expected = F.scaled_dot_product_attention(q[r : r + 1].float(), keys, values, scale=0.125)
        torch.testing.assert_close(out[r : r + 1].float(), expected, atol=tolerance, rtol=tolerance)
    with pytest.raises(ValueError, match="do not match"):
        cpu_decode.attend_rows(q, flat_k, flat_v, cpu_decode.row_extents(starts[:3], lengths[:3]), 0.125)
    with pytest.raises(ValueError, match="do not match"):
        cpu_decode.row_extents(starts, lengths[:3])
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_decode.attend_rows(q, flat_k, flat_v, cpu_decode.row_extents(starts, lengths + torch.tensor([0, 0, 0, 1])),
                               0.125)
    with pytest.raises(ValueError, match="reads none"):
        cpu_decode.row_extents(starts, lengths * torch.tensor([1, 0, 1, 1]))
    with pytest.raises(ValueError, match="before the cache"):
        cpu_decode.row_extents(starts - 1, lengths)


def test_only_fewer_rows_than_threads_cut_a_rows_heads():
    assert cpu_decode.head_parts(rows=1, heads=4, threads=2) == 2
    assert cpu_decode.head_parts(rows=1, heads=4, threads=16) == 4
    assert cpu_decode.head_parts(rows=3, heads=4, threads=8) == 3
    assert cpu_decode.head_parts(rows=2, heads=4, threads=2) == 1
    assert cpu_decode.head_parts(rows=24, heads=12, threads=2) == 1


@pytest.mark.parametrize(("rows", "heads", "parts"), [(1, 3, 2), (2, 3, 3), (1, 4, 3)])
def test_a_rows_heads_cut_into_parts_give_the_same_answer(monkeypatch, rows, heads, parts):
    """Parts of two and one head, one head each, and (4 heads in 3 parts of 2) an empty last part."""
    monkeypatch.setattr(cpu_decode, "head_parts", lambda *_: parts)
    keys, values = _stripes(torch.float32, rows=rows, cap=70, heads=heads, slots=65)
    q = torch.randn(rows, heads, 2, keys.shape[3], generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(rows, 1, 1, 65)
    mask[0, ..., 40:] = float("-inf")
    out = cpu_decode.attend(q, keys, values, mask, 0.125)
    torch.testing.assert_close(out, _reference(q, keys, values, mask, 0.125), atol=1e-5, rtol=1e-5)


def test_the_kernel_reads_only_the_slots_asked_for():
    keys, values = _stripes(torch.float32, slots=10)
    q = torch.randn(keys.shape[0], keys.shape[1], 2, keys.shape[3])
    # the slots past the view hold garbage the kernel must not read
    keys.transpose(1, 2).as_strided((keys.shape[0], 30, keys.shape[1], keys.shape[3]),
                                    (keys.stride(0), keys.stride(2), keys.stride(1), 1))[:, 10:] = float("nan")
    values.transpose(1, 2).as_strided((values.shape[0], 30, values.shape[1], values.shape[3]),
                                      (values.stride(0), values.stride(2), values.stride(1), 1))[:, 10:] = float("nan")
    out = cpu_decode.attend(q, keys, values, None, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(q, keys, values, None, 0.125), atol=1e-5, rtol=1e-5)


def test_layouts_the_kernel_cannot_read_go_to_torch():
    keys, values = _stripes(torch.float32)
    assert not cpu_decode.usable(keys.contiguous(), values.contiguous())  # head-major: heads not side by side
    assert not cpu_decode.usable(keys, values.contiguous())  # values strided unlike keys
    assert not cpu_decode.usable(keys.to(torch.float16), values.to(torch.float16))
    small = _stripes(torch.bfloat16, dim=32)
    assert not cpu_decode.usable(*small)  # bfloat16 below head_dim 64: torch's kernel
    packed = torch.randn(1, 12, 7, 32)  # fused q|k|v projection: a slot's keys are not the slot's start
    k = packed[..., 2:4, :].transpose(1, 2)
    assert not cpu_decode.usable(k, k)
    store = torch.randn(3, 40, 3, 64)  # rows 40 slots apart
    rows = store.transpose(1, 2)
    assert cpu_decode.usable(rows, rows)
    # rows closer than their slots (overlapping), broadcast, or a row stride that is not whole slots
    overlap = store.view(-1).as_strided((3, 3, 40, 64), (20 * 192, 64, 192, 1))
    assert not cpu_decode.usable(overlap, overlap)
    shared = store[:1].transpose(1, 2).expand(3, -1, -1, -1)
    assert not cpu_decode.usable(shared, shared)
    ragged = store.view(-1).as_strided((2, 3, 10, 64), (40 * 192 + 8, 64, 192, 1))
    assert not cpu_decode.usable(ragged, ragged)
    # the last row's whole stripe must lie inside each tensor's storage, values' too
    tail = torch.randn(2 * 40 * 192 + 10 * 192).as_strided((3, 3, 10, 64), (40 * 192, 64, 192, 1))
    assert not cpu_decode.usable(tail, tail)
    assert not cpu_decode.usable(rows[:, :, :10], tail)


def test_masks_of_one_slot_broadcast_and_short_masks_are_refused():
    keys, values = _stripes(torch.float32)
    rows, heads, slots, dim = keys.shape
    q = torch.randn(rows, heads, 2, dim, generator=torch.Generator().manual_seed(4))
    one = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0]).view(rows, 1, 1, 1)  # the same bias on every slot of a row
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=one, scale=0.125)
    torch.testing.assert_close(cpu_decode.attend(q, keys, values, one, 0.125), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="covers 20 slots"):
        cpu_decode.attend(q, keys, values, torch.zeros(rows, 1, 1, 20), 0.125)


def test_a_query_that_is_not_contiguous_is_read_right():
    keys, values = _stripes(torch.float32)
    rows, heads, slots, dim = keys.shape
    wide = torch.randn(rows, heads, 2, 2 * dim, generator=torch.Generator().manual_seed(5))
    q = wide[..., ::2]  # every other channel
    torch.testing.assert_close(cpu_decode.attend(q, keys, values, None, 0.125),
                               _reference(q, keys, values, None, 0.125), atol=1e-5, rtol=1e-5)


def test_warm_up_compiles_both_dtypes_and_a_broken_numba_falls_back(monkeypatch):
    assert cpu_decode.warm_up()
    kernel = cpu_decode._kernel()[1]
    assert len(kernel.signatures) >= 2  # float32 and bfloat16 (uint16 bits) caches
    keys, values = _stripes(torch.float32)
    cpu_decode._kernel.cache_clear()
    cpu_decode._ready.cache_clear()
    try:
        import builtins
        real_import = builtins.__import__

        def no_numba(name, *args, **kwargs):
            if name == "numba" or name.startswith("numba."):
                raise ImportError("numba is not installed")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_numba)
        assert not cpu_decode.warm_up()
        assert not cpu_decode.usable(keys, values)
    finally:
        monkeypatch.undo()
        cpu_decode._kernel.cache_clear()
        cpu_decode._ready.cache_clear()
    assert cpu_decode.usable(keys, values)


def test_the_numba_kernels_leave_torch_s_thread_count_as_the_job_set_it():
    """numba's OpenMP pool, when it starts, sets the process's OpenMP thread count to every core it may use,
    and torch reads its own from there: a job (or benchmark) asking for one thread ran every later torch op
    on all of them. A fresh process asks for one thread, runs each parallel kernel, and still has one."""
    import os

    probe = ("import torch; torch.set_num_threads(1)\n"
             "from flashx_batch.backends import cpu_decode, cpu_moe\n"
             "from flashx_batch.quant import dequant_kernels\n"
             "assert cpu_decode.warm_up() and cpu_moe.kernel() is not None and dequant_kernels.kernels() is not None\n"
             "x, w = torch.randn(4, 8), torch.randn(2, 6, 8)\n"
             "assert cpu_moe.expert_rows(x, torch.tensor([0, 0, 1, 1]), w) is not None\n"
             "import numba; print(torch.get_num_threads(), numba.get_num_threads())")
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["1", "1"]


def test_a_job_compiles_only_the_reads_it_makes():
    """A fresh process that reads one layout of one dtype holds that one signature of the kernel (compiled
    or loaded from the disk cache), not all six: a first run does not pay for reads it never makes."""
    probe = ("import torch; from flashx_batch.backends import cpu_decode; "
             "flat = torch.zeros(8, 2, 16); assert cpu_decode.usable_paged(flat, flat, 'extents'); "
             "print(len(cpu_decode._kernel()[1].signatures))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"


def test_a_second_process_loads_the_compiled_kernels_from_the_disk_cache():
    """Each Ray actor is a process of its own: the kernels must come from numba's on-disk cache after the
    first compile, not be compiled again (~20 s for the decode kernel here; a jitted helper captured by
    a kernel's closure once made every process miss the cache, and a node added mid-job came up too
    late to get work)."""
    probe = ("from flashx_batch.backends import cpu_decode; from flashx_batch.quant import int8_kernels, row_kernel; "
             "cpu_decode.warm_up(); fused = int8_kernels.compiled_kernels(); "
             "kernels = [cpu_decode._kernel()[1], row_kernel.kernel()] + ([] if fused is None else "
             "[fused.norm_round, fused.residual_norm_round, fused.rope_write, fused.dequant_rows]); "
             "print(min(sum(k.stats.cache_hits.values()) for k in kernels))")
    for _ in range(2):  # the first may compile and write the cache; the second must read it
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 1, "a kernel was compiled again instead of loaded from the cache"


@pytest.mark.parametrize("options", [dict(cache_policy="static"),
                                     dict(cache_policy="segment_sparse", kv_evict_share=0.5),
                                     dict(cache_policy="static", prefix_cache_tokens=32)])
def test_decoding_through_the_kernel_gives_torch_attention_s_tokens(tiny_models, monkeypatch, options):
    """Greedy generation with the kernel and with torch's attention: the same tokens, static,
    segment-sparse (merged slots' bias in the mask) and paged (shared prefixes: a boolean mask), rows
    of different lengths (masked runs, or extents each read to its own length)."""
    from flashx_batch import Engine, SamplingParams

    path = tiny_models["llama"][0]
    prompts = [[5 + (i * 7 + j) % 50 for j in range(20 + 9 * i)] for i in range(4)]
    prompts += [prompts[1][:18] + [7, 9, 11]]  # shares a whole segment with a batch-mate
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = Engine.from_pretrained(path, backend="cpu", max_batch_size=4, max_input_len=64, max_output_len=12,
                                    segment_size=8, **options)
    calls = {"attend": 0, "attend_paged": 0, "attend_rows": 0}
    for name in calls:
        real = getattr(cpu_decode, name)
        monkeypatch.setattr(cpu_decode, name, lambda *a, name=name, real=real: calls.update({name: calls[name] + 1})
                            or real(*a))
    kernel = [r.token_ids for r in engine.generate(prompts, params)]
    reached = calls["attend_paged"] if options.get("prefix_cache_tokens") else calls["attend"] + calls["attend_rows"]
    assert reached, f"the decode steps did not reach the kernel: {calls}"
    monkeypatch.setattr(cpu_decode, "usable", lambda keys, values: False)
    monkeypatch.setattr(cpu_decode, "usable_paged", lambda keys, values, layout="pages": False)
    assert [r.token_ids for r in engine.generate(prompts, params)] == kernel
