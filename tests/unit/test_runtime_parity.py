"""Lossless path = transformers: greedy tokens identical, prefill logits within 1e-4 (float32, CPU)."""

import dataclasses

import pytest
import torch
from model_factory import ARCHS
from parity_support import assert_batch_and_position_independent, cpu_engine, hf_greedy, prompts

from flashx_batch import SamplingParams
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.forward_passes import ForwardPasses
from flashx_batch.runtime.layouts.extents import extent_runs
from flashx_batch.runtime.layouts.stripes import attention_groups

NEW_TOKENS = 32


_prompts, _engine, _hf_greedy = prompts, cpu_engine, hf_greedy


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_prefill_logits_match_transformers(arch, tiny_models):
    model_dir, hf = tiny_models[arch]
    engine = _engine(model_dir)
    prompts = _prompts(1, (5, 17, 9, 30, 12))  # 5 rows > max_batch_size: two batches
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert len(set(out.token_ids)) >= 8  # a varied continuation, not one token repeated
        assert out.token_ids == _hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.finish_reason == "length" and out.num_input_tokens == len(prompt)
    for prompt, logits in zip(prompts, engine.score(prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "glm4"])
def test_row_output_is_independent_of_batch_and_position(arch, tiny_models):
    model_dir, _ = tiny_models[arch]
    engine = _engine(model_dir, sort_by_length=False)
    target = _prompts(7, (11,))[0]
    others = _prompts(8, (3, 25, 40, 8, 19))
    alone = assert_batch_and_position_independent(engine, target, others)
    # rows that finish earlier leave the batch (their stripes are compacted): the survivor is unchanged
    mixed = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 24, 1, 9)]
    outs = engine.generate([others[0], target, others[1], others[2]], mixed)
    assert outs[1].token_ids == alone
    assert [len(o.token_ids) for o in outs] == [3, 24, 1, 9]
    assert engine.scheduler.allocator.is_whole()


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_tracks_it(tiny_models):
    model_dir, _ = tiny_models["qwen3"]
    full = _engine(model_dir, dtype="auto")
    half = _engine(model_dir, dtype="bfloat16")
    assert full.dtype == torch.float32 and half.dtype == torch.bfloat16
    prompt = _prompts(3, (20,))
    a, b = full.score(prompt)[0], half.score(prompt)[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item() + 0.05


@pytest.mark.parametrize(("arch", "policy", "layout"), [("llama", "static", "extents"), ("llama", "static", "stripes"),
                                                     ("qwen3", "static", "auto"), ("glm4", "segment_sparse", "auto")])
def test_inflight_refill_matches_static_batches_with_fewer_steps(arch, policy, layout, tiny_models):
    """A finished row's KV (extent or stripe) takes the next queued row mid-batch: every row's tokens
    (greedy and seeded sampling, rows stopping on their first token, on a stop id, on length) equal the
    pure static-batch run, the queue runs as one batch in fewer decode steps, and the arena comes back whole."""
    model_dir, _ = tiny_models[arch]
    lengths = (12, 40, 5, 33, 64, 9, 21, 50, 3, 17, 28)
    prompts = _prompts(11, lengths)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 1, 12, 40, 6, 25, 2, 18, 33, 9, 14)]
    params[3] = SamplingParams(max_new_tokens=40, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    params[6] = SamplingParams(max_new_tokens=40, temperature=1.0, seed=9, stop_token_ids=[7, 8, 9, 10, 11])
    runs = {}
    for refill in (False, True):
        engine = _engine(model_dir, sort_by_length=False, refill=refill, cache_policy=policy, kv_layout=layout)
        assert engine.uses_extents == (refill and layout != "stripes" and policy == "static")
        outs = engine.generate(prompts, params)
        runs[refill] = ([(o.token_ids, o.finish_reason) for o in outs], engine.last_stats)
        assert engine.scheduler.allocator.is_whole()
    (static_outs, static_stats), (refill_outs, refill_stats) = runs[False], runs[True]
    assert refill_outs == static_outs
    assert [len(t) for t, _ in refill_outs][:3] == [30, 1, 12]
    assert refill_stats.batches == 1 and static_stats.batches == -(-len(prompts) // 4)
    assert refill_stats.decode_steps < static_stats.decode_steps
    assert refill_stats.rows == len(prompts) and refill_stats.output_tokens == static_stats.output_tokens
    assert refill_stats.input_tokens == sum(lengths)
    if policy == "static":  # packed prefill: rows of different lengths compute no padding at all
        assert static_stats.padding_efficiency == refill_stats.padding_efficiency == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_last_token_only_prefills_give_the_full_forward_last_logits(arch, tiny_models):
    """Packed prefill and extend run their final layer on each row's last token only; those logits
    must still be transformers' last-position logits (equal lengths, mixed lengths, one row)."""
    model_dir, hf = tiny_models[arch]
    engine = _engine(model_dir)
    runner = engine.runner
    for lengths in ((12, 12, 12), (5, 30, 17)):
        prompts = _prompts(4, lengths)
        packed = runner.passes.prefill_packed(prompts)
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0, -1].float()
            assert (packed[i] - ref).abs().max().item() <= 1e-4
            alone, scores = runner.passes.extend(prompt, 0, 0, 0, observe=4)
            assert alone.shape == (1, ref.shape[0]) and scores.shape == (len(prompt),)
            assert (alone[0] - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "glm4"])
def test_growing_batches_match_fixed_batches_and_take_more_rows(arch, tiny_models):
    """batch_growth: once the longest rows have left, the stripes are re-cut shorter mid-batch and more
    rows decode at once. Every row's tokens (greedy, seeded sampling, a stop id) equal the fixed-size
    run, sorted or not, in fewer decode steps; the arena comes back whole and in its base layout. In
    arrival order with the long rows last, the stripes stay as long as the longest row still to come."""
    model_dir, _ = tiny_models[arch]
    lengths = (60, 58, 55, 50, 20, 18, 16, 14, 12, 10, 9, 8, 7, 6, 5, 4)
    prompts = _prompts(12, lengths)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (10, 4, 8, 6) + (6, 9, 7, 10) * 3]
    params[5] = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    params[9] = SamplingParams(max_new_tokens=10, temperature=1.0, seed=9, stop_token_ids=[7, 8, 9, 10, 11])
    runs = {}
    for growth, order in ((1, "sorted"), (4, "sorted"), (4, "arrival"), (4, "long_last")):
        engine = _engine(model_dir, batch_growth=growth, sort_by_length=order == "sorted", kv_layout="stripes")
        rows = list(range(len(prompts)))[::-1] if order == "long_last" else list(range(len(prompts)))
        outs = engine.generate([prompts[i] for i in rows], [params[i] for i in rows])
        by_row = dict(zip(rows, ((o.token_ids, o.finish_reason) for o in outs)))
        runs[growth, order] = ([by_row[i] for i in range(len(prompts))], engine.last_stats)
        geometry = engine.geometry
        assert engine.scheduler.allocator.is_whole() and (geometry.max_rows, geometry.row_capacity) == (4, 112)
    fixed_outs, fixed = runs[1, "sorted"]
    assert fixed.peak_rows == 4 and fixed.relayouts == 0
    for key in ((4, "sorted"), (4, "arrival")):
        outs, grown = runs[key]
        assert outs == fixed_outs, key
        assert grown.relayouts >= 1 and grown.peak_rows > 4, key
        assert grown.decode_steps < fixed.decode_steps and grown.output_tokens == fixed.output_tokens
    outs, long_last = runs[4, "long_last"]
    # the longest row ends with 60 + 10 slots -> 5 segments: 5 stripes of 80 from the start, never re-cut
    assert outs == fixed_outs and long_last.peak_rows == 5 and long_last.relayouts == 0


@pytest.mark.parametrize("arch", ["llama", "glm4"])
def test_extent_batches_match_fixed_batches_and_take_more_rows(arch, tiny_models):
    """kv_layout=extents (the CPU default): each row in an extent of its own prompt + new tokens, so
    short rows join while a long one still decodes. Every row's tokens (greedy, seeded sampling, a stop
    id) equal the fixed-size striped run, sorted or not; arrival order with long rows late takes fewer
    decode steps and more rows than stripes can; fragmented free space is compacted (a copy of the
    live rows) and the arena comes back whole."""
    model_dir, _ = tiny_models[arch]
    lengths = (20, 60, 10, 58, 12, 55, 8, 50, 30, 62, 9, 40, 6, 61, 5, 45)
    prompts = _prompts(21, lengths)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 40, 3, 30, 2, 35, 4, 20, 5, 44, 3, 10,
                                                                          2, 40, 3, 12)]
    params[4] = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    params[8] = SamplingParams(max_new_tokens=10, temperature=1.0, seed=9, stop_token_ids=[7, 8, 9, 10, 11])
    runs = {}
    for layout, growth, sort in (("stripes", 1, True), ("stripes", 4, False), ("extents", 4, True),
                                 ("extents", 4, False)):
        engine = _engine(model_dir, kv_layout=layout, batch_growth=growth, sort_by_length=sort)
        assert engine.uses_extents == (layout == "extents")
        runs[layout, sort] = ([(o.token_ids, o.finish_reason) for o in engine.generate(prompts, params)],
                              engine.last_stats)
        assert engine.scheduler.allocator.is_whole()
    fixed_outs, _ = runs["stripes", True]
    for key, (outs, _) in runs.items():
        assert outs == fixed_outs, key
    striped, extents = runs["stripes", False][1], runs["extents", False][1]
    assert extents.decode_steps < striped.decode_steps and extents.peak_rows > striped.peak_rows
    assert extents.relayouts >= 1  # compactions: the arrival order leaves holes too short for the long rows
    assert extents.output_tokens == striped.output_tokens


def test_extent_batches_take_the_decode_steps_a_paged_cache_would(tiny_models):
    """With extents a row joins as soon as the free segments hold its prompt + new tokens (compaction
    undoes fragmentation): exactly the decode steps of per-row (paged) allocation, counted by
    `schedule_count.paged_decode_steps`, sorted or not."""
    from flashx_batch.bench.schedule_count import paged_decode_steps
    from flashx_batch.runtime.scheduler import bucket_key

    model_dir, _ = tiny_models["llama"]
    g = torch.Generator().manual_seed(4)
    lengths = [int(torch.randint(2, 64, (1,), generator=g)) for _ in range(30)]
    new = [int(torch.randint(1, 48, (1,), generator=g)) for _ in range(30)]
    prompts = _prompts(22, tuple(lengths))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new]
    for sort in (True, False):
        engine = _engine(model_dir, sort_by_length=sort)
        engine.generate(prompts, params)
        geometry = engine.geometry
        needs = [16 * geometry.segments_for(n + k) for n, k in zip(lengths, new)]
        order = sorted(range(30), key=lambda i: bucket_key(needs[i], new[i], extents=True)) if sort else list(range(30))
        counted = paged_decode_steps([needs[i] for i in order], [new[i] for i in order], geometry.striped_slots,
                                     geometry.base_rows * engine.options.batch_growth)
        assert engine.last_stats.decode_steps == counted, sort
        assert engine.last_stats.relayouts >= 1  # compactions happened: fragmentation never made a row wait


def test_extent_layout_applies_where_rows_keep_plain_stripes_otherwise():
    """auto picks extents on CPU for growing refilled static batches; stripes elsewhere (segment-sparse,
    rolling long prompts, batch_growth=1, no refill, prefix reuse, or a backend that prefers stripes)."""
    assert _engine(None).uses_extents
    assert not _engine(None, kv_layout="stripes").uses_extents
    assert not _engine(None, cache_policy="segment_sparse").uses_extents
    assert not _engine(None, long_input="rolling_merge").uses_extents
    assert not _engine(None, batch_growth=1, kv_layout="extents").uses_extents
    assert not _engine(None, refill=False, kv_layout="extents").uses_extents  # static batches: stripes
    assert not _engine(None, prefix_cache_tokens=64).uses_extents  # paged batches, striped fallback
    engine = _engine(None)
    engine.backend.prefers_row_extents = False  # this engine's backend instance only
    assert not engine.uses_extents
    with pytest.raises(ConfigError, match="kv_layout"):
        _engine(None, kv_layout="paged")


def test_extent_runs_read_adjacent_equal_extents_together():
    """One decode step's runs for rows in extents: rows next to each other in the batch and in the arena,
    with equal extents, share one strided view; every other row is read alone, exactly to its length."""
    runs = extent_runs
    # rows 0-2: 64-slot extents back to back; row 3 elsewhere
    assert runs([0, 64, 128, 320], [64, 64, 64, 32], [60, 50, 64, 20]) == ((0, 3, 0, 64, 64, False),
                                                                           (3, 4, 320, 20, 20, True))
    assert runs([0, 64], [64, 64], [33, 33]) == ((0, 2, 0, 64, 33, True),)  # equal lengths: no mask
    assert runs([64, 0], [64, 64], [10, 20]) == ((0, 1, 64, 10, 10, True), (1, 2, 0, 20, 20, True))  # out of order
    assert runs([0, 64], [64, 48], [10, 20]) == ((0, 1, 0, 10, 10, True), (1, 2, 64, 20, 20, True))  # unequal
    g = torch.Generator().manual_seed(3)
    for _ in range(200):  # random batches: the runs tile the rows in order and read every row's slots
        n = int(torch.randint(1, 9, (1,), generator=g))
        sizes = [16 * int(torch.randint(1, 4, (1,), generator=g)) for _ in range(n)]
        starts, at = [], 0
        for size in sizes:
            at += 16 * int(torch.randint(0, 2, (1,), generator=g))  # sometimes a gap
            starts.append(at)
            at += size
        lengths = [int(torch.randint(1, size + 1, (1,), generator=g)) for size in sizes]
        out = runs(starts, sizes, lengths)
        assert [r[0] for r in out] == [0] + [r[1] for r in out[:-1]] and out[-1][1] == n
        for a, b, first, stride, slots, aligned in out:
            assert first == starts[a] and slots == max(lengths[a:b]) and aligned == (min(lengths[a:b]) == slots)
            assert all(starts[i] == first + (i - a) * stride and lengths[i] <= stride for i in range(a, b))
            if b - a == 1:
                assert stride == lengths[a]


def test_growing_batch_layouts():
    """Layouts: as many rows as the stripe region holds for the longest row, capped at batch_growth x
    the base rows; static cache only."""
    engine = _engine(None, max_batch_size=4, max_input_len=64, max_output_len=48)  # bundled model
    assert engine.grows_batches and engine.geometry.striped_slots == 4 * 112
    assert engine.layout_for(112) == (112, 4)  # full-length rows: the base layout
    assert engine.layout_for(40) == (48, 9)  # 40 slots -> 3 segments each: 9 rows of 48 in 448 slots
    assert engine.layout_for(100) == (112, 4)  # 7 segments: still only 4 rows; the stripes keep the slack
    assert engine.layout_for(1) == (16, 16)  # 28 rows would fit: capped at batch_growth x 4
    assert not _engine(None, max_batch_size=4, max_input_len=64, max_output_len=48, batch_growth=1).grows_batches
    assert not _engine(None, max_batch_size=4, max_input_len=64, max_output_len=48,
                       cache_policy="segment_sparse").grows_batches


def test_a_failed_re_cut_surfaces_its_own_error_and_leaves_the_arena_whole(tiny_models, monkeypatch):
    """If moving the live rows into a new layout fails (say, out of memory for the copy), generate raises
    that error, not a bookkeeping one, and the engine is back in its base layout with every segment free."""
    model_dir, _ = tiny_models["llama"]
    engine = _engine(model_dir, kv_layout="stripes")
    prompts = _prompts(13, (60, 58, 20, 18, 16, 14, 12, 10, 9, 8))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 3) + (6,) * 8]

    copy, recuts = engine.runner.arena.move_slots, []

    def fail(moves):  # the copies of a re-cut run while the scheduler's layout is already the new one
        if engine.geometry.row_capacity != 112:
            recuts.append(moves)
            raise RuntimeError("simulated: no memory for the copy")
        copy(moves)

    monkeypatch.setattr(engine.runner.arena, "move_slots", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(prompts, params)
    geometry = engine.geometry
    assert recuts and engine.scheduler.allocator.is_whole()
    assert (geometry.max_rows, geometry.row_capacity) == (4, 112)
    monkeypatch.undo()
    assert len(engine.score([prompts[0] + [5] * 50])[0]) == 110  # a full-length row fits again


def test_a_failed_compaction_surfaces_its_own_error_and_leaves_the_arena_whole(tiny_models, monkeypatch):
    """If copying the rows' KV down fails mid-compaction, generate raises that error, not a bookkeeping
    one, and every segment is free again."""
    model_dir, _ = tiny_models["llama"]
    engine = _engine(model_dir, sort_by_length=False)
    assert engine.uses_extents
    lengths = (20, 60, 10, 58, 12, 55, 8, 50, 30, 62, 9, 40, 6, 61, 5, 45)
    news = (2, 40, 3, 30, 2, 35, 4, 20, 5, 44, 3, 10, 2, 40, 3, 12)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]

    def fail(moves):
        raise RuntimeError("simulated: no memory for the copy")

    monkeypatch.setattr(engine.runner.arena, "move_slots", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(_prompts(21, lengths), params)
    assert engine.scheduler.allocator.is_whole()
    monkeypatch.undo()
    assert len(engine.generate(_prompts(21, lengths), params)) == 16


def test_static_batches_grow_to_the_rows_they_take(tiny_models):
    """refill=false: each static batch is cut for its own longest row, not for a long row queued later."""
    model_dir, _ = tiny_models["llama"]
    prompts = _prompts(14, (10,) * 16 + (90,))
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 17
    outs = {}
    for growth in (1, 4):
        engine = _engine(model_dir, refill=False, sort_by_length=False, batch_growth=growth, max_input_len=96,
                         max_output_len=16)
        outs[growth] = [o.token_ids for o in engine.generate(prompts, params)]
        sizes = engine.last_stats.batch_sizes
    assert outs[1] == outs[4]
    assert sizes == [16, 1]  # 16 rows of 16 slots at once (4 x 4 rows, the cap), then the long row alone


def test_attention_groups_cut_where_the_fewest_slots_are_read():
    """One decode step's attention: one call unless two runs of rows read at least the backend's
    minimum fewer bytes of a layer's cache; the cut is the cheapest of every possible cut."""
    groups, limit = attention_groups, 256 << 10
    assert groups([600, 40, 40, 40], 1024, limit) == ((0, 1, 600), (1, 4, 40))
    assert groups([40, 600, 40, 40, 41], 1024, 0) == ((0, 2, 600), (2, 5, 41))
    assert groups([600, 40, 40, 40], 1024, None) is None  # the backend never splits
    assert groups([50] * 6, 1024, 0) is None  # equal rows: nothing to save
    assert groups([600], 1024, 0) is None
    assert groups([600, 40, 40, 40], 100, limit) is None  # 168,000 bytes saved: not worth a call
    saved = (2400 - 720) * 1024  # one call reads 4 x 600 slots, the cut 600 + 3 x 40
    assert groups([600, 40, 40, 40], 1024, saved) is not None and groups([600, 40, 40, 40], 1024, saved + 1) is None
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(1, 700, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
        n = len(lengths)
        cheapest = min(k * max(lengths[:k]) + (n - k) * max(lengths[k:]) for k in range(1, n))
        groups = attention_groups(lengths, 1, 0)
        if cheapest == n * max(lengths):
            assert groups is None
            continue
        (a, cut, first), (cut2, end, second) = groups
        assert (a, cut2, end) == (0, cut, n) and first == max(lengths[:cut]) and second == max(lengths[cut:])
        assert cut * first + (n - cut) * second == cheapest


@pytest.mark.parametrize(("arch", "policy"), [("llama", "static"), ("glm4", "segment_sparse")])
def test_split_decode_attention_gives_the_same_tokens(arch, policy, tiny_models, monkeypatch):
    """Rows of very different lengths decode in two attention calls, each reading its rows' stripes only
    up to its own longest row: every row's tokens (greedy, seeded sampling; merged rows' biased masks
    with segment_sparse) equal the one-call run, and the split really ran."""
    model_dir, _ = tiny_models[arch]
    lengths = (60, 4, 6, 5, 58, 3, 7, 50, 9, 8, 2, 40)
    prompts = _prompts(13, lengths)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 30, 25, 20, 6, 28, 9, 14, 22, 5, 16, 8)]
    params[2] = SamplingParams(max_new_tokens=25, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    split_steps = []
    decode = ForwardPasses.decode

    def counting(self, *args, groups=None, **kw):
        split_steps.append(groups is not None)
        return decode(self, *args, groups=groups, **kw)

    monkeypatch.setattr(ForwardPasses, "decode", counting)
    runs = {}
    for threshold in (None, 0):  # never split, split whenever a slot is saved
        split_steps.clear()
        engine = _engine(model_dir, sort_by_length=False, cache_policy=policy, kv_layout="stripes")
        cfg = engine.config  # one layer's keys + values per slot; the CPU backend's default threshold
        assert engine.runner.arena.layer_slot_bytes() == 2 * cfg.num_kv_heads * cfg.head_dim * 4
        assert engine.backend.attention_split_min_bytes == 256 << 10
        # the scheduler takes the backend's threshold when the engine starts: set it there for this engine
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, split_min_bytes=threshold)
        runs[threshold] = [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, params)]
        assert engine.scheduler.allocator.is_whole()
        assert any(split_steps) == (threshold == 0)
    assert runs[0] == runs[None]
