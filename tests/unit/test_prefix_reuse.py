"""Prefix reuse: lossless, reference counts return to the cache's own, the arena is whole after."""

import pytest
import torch
from model_factory import ARCHS

from flashx_batch import Engine, SamplingParams
from flashx_batch.kvcache.prefix_cache import block_keys


def _engine(model_dir, **kw):
    opts = dict(backend="cpu", dtype="float32", max_batch_size=4, max_input_len=96, max_output_len=16,
                segment_size=8)
    opts.update(kw)
    return Engine.from_pretrained(model_dir, **opts)


def _few_shot(seed=3, groups=2, per_group=5, prefix_len=50):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups):
        prefix = torch.randint(3, 256, (prefix_len,), generator=g).tolist()
        for _ in range(per_group):
            rows.append(prefix + torch.randint(3, 256, (int(torch.randint(1, 20, (1,), generator=g)),),
                                               generator=g).tolist())
    return rows


def _only_cache_holds_segments(engine):
    alloc, cache = engine.scheduler.allocator, engine.scheduler.prefix_cache
    cached = set(cache._blocks.values())
    trash = engine.geometry.num_segments - 1
    for s, count in enumerate(alloc.refcount):
        expected = 1 if s in cached or s == trash else 0
        assert count == expected, (s, count, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_reuse_is_token_identical(arch, tiny_models):
    model_dir = tiny_models[arch][0]
    rows = _few_shot()
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (16, 3, 9, 1, 16, 12, 16, 2, 7, 16)]
    plain = _engine(model_dir).generate(rows, params)
    reuse = _engine(model_dir, prefix_cache_tokens=256)
    outs = reuse.generate(rows, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = reuse.last_stats.as_dict()
    # 48 of each 50-token prefix are whole 8-token blocks: computed once per group, read by every row
    assert stats["cached_prompt_tokens"] == 10 * 48
    assert reuse.last_stats.prefix_tokens_computed == 2 * 48
    _only_cache_holds_segments(reuse)
    reuse.scheduler.prefix_cache.clear()
    assert reuse.scheduler.allocator.refcount.count(0) == reuse.geometry.num_segments - 1  # trash only


def test_cache_survives_batches_and_evicts_under_its_cap(tiny_models):
    model_dir = tiny_models["llama"][0]
    rows = _few_shot(seed=9, groups=3, per_group=4, prefix_len=40)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = _engine(model_dir).generate(rows, params)
    small = _engine(model_dir, prefix_cache_tokens=48)  # room for one group's 40-token prefix (5 blocks)
    first = small.generate(rows[:4], params)  # group 0 fills the cache
    assert len(small.scheduler.prefix_cache) == 5
    again = small.generate(rows[:4], params)  # a later call hits without computing anything
    assert small.last_stats.prefix_tokens_computed == 0 and small.last_stats.cached_prompt_tokens == 4 * 40
    rest = small.generate(rows[4:], params)  # groups 1 and 2 evict group 0's blocks
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in plain]
    assert [o.token_ids for o in again] == [o.token_ids for o in plain[:4]]
    assert len(small.scheduler.prefix_cache) <= 6
    _only_cache_holds_segments(small)


def test_block_keys_chain_the_prefix():
    a = block_keys(list(range(40)), 8, 39)
    b = block_keys([99] + list(range(1, 40)), 8, 39)
    assert len(a) == 4 and a[0] != b[0] and a[1] != b[1]  # a different first block changes every later key
    assert block_keys(list(range(40)), 8, 39) == a


def test_multi_turn_chat_histories_are_computed_once(tmp_path):
    """5-turn conversations, one row per turn (the whole history + the new message, chat template
    applied): prefix reuse computes >= 60 % fewer prompt tokens, with identical outputs."""
    import shutil

    from model_factory import build

    from flashx_batch.bench.prefix_reuse import chat_rows
    from flashx_batch.runtime.options import bundled_model_dir
    from flashx_batch.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(bundled_model_dir())
    build("llama", tmp_path, vocab_size=tokenizer.vocab_size, max_position_embeddings=1024)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir() / name, tmp_path / name)
    rows = chat_rows(tokenizer, conversations=3, turns=5, turn_tokens=24)
    assert len(rows) == 15 and all(rows[i] == rows[i + 1][: len(rows[i])] for i in range(4))  # history is a prefix
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    options = dict(max_input_len=max(map(len, rows)), max_output_len=4, segment_size=8)
    plain = _engine(tmp_path, **options)
    reuse = _engine(tmp_path, prefix_cache_tokens=4096, **options)
    assert [o.token_ids for o in reuse.generate(rows, params)] == [o.token_ids for o in plain.generate(rows, params)]
    computed, full = reuse.last_stats.prefill_tokens_computed, plain.last_stats.prefill_tokens_computed
    assert full == sum(map(len, rows)) and computed <= 0.4 * full, (computed, full)


def test_eviction_never_takes_blocks_the_current_row_just_matched(tiny_models):
    """A cache full of this row's own matched blocks must not evict them to make room for its next ones."""
    model_dir = tiny_models["llama"][0]
    g = torch.Generator().manual_seed(21)
    base = torch.randint(3, 256, (64,), generator=g).tolist()
    first = [base[:32] + [7, 8, 9], base[:32] + [10, 11]]  # caches 4 blocks of 8 tokens
    second = [base + [12, 13], base + [14, 15, 16]]  # shares 8 blocks: needs 4 more than the cap allows
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = _engine(model_dir).generate(first + second, params)
    small = _engine(model_dir, prefix_cache_tokens=48)
    outs = small.generate(first, params) + small.generate(second, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    _only_cache_holds_segments(small)


def test_rows_after_an_unshared_batch_still_share(tiny_models):
    """The first candidates share no block, so they run as a plain striped batch; that batch must not
    refill itself with the rest of the queue, or the later rows (which do share) would lose reuse."""
    model_dir = tiny_models["llama"][0]
    g = torch.Generator().manual_seed(4)
    unique = [[3, i + 4] + torch.randint(3, 256, (30,), generator=g).tolist() for i in range(20)]  # sort first
    shared = [[250] + r[1:] for r in _few_shot(seed=5, groups=1, per_group=6, prefix_len=40)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    reuse = _engine(model_dir, prefix_cache_tokens=256)
    outs = reuse.generate(unique + shared, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _engine(model_dir).generate(unique + shared, params)]
    assert reuse.last_stats.cached_prompt_tokens >= 6 * 40 - 8 * 6  # the six shared rows read cached blocks


def test_striped_batches_after_a_paged_batch_start_clean(tiny_models):
    """Rows that share a prefix sort first and run paged; the unshared rows after them run in stripes,
    within one call and in the next call: no state of the paged batch (its slot tables) may leak into
    them. Tokens equal the engine without prefix reuse, with rows stopping early in every batch."""
    model_dir = tiny_models["llama"][0]
    g = torch.Generator().manual_seed(6)
    shared = [[3] + r[1:] for r in _few_shot(seed=7, groups=1, per_group=6, prefix_len=40)]  # sort first
    unique = [[250, i + 4] + torch.randint(3, 256, (int(torch.randint(5, 60, (1,), generator=g)),),
                                           generator=g).tolist() for i in range(10)]
    news = ((1, 9, 3, 16, 2, 7) * 3)[: len(shared + unique)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    plain = _engine(model_dir)
    reuse = _engine(model_dir, prefix_cache_tokens=256)
    for prompts, p in ((shared + unique, params), (unique, params[: len(unique)]), (shared, params[: len(shared)])):
        assert [o.token_ids for o in reuse.generate(prompts, p)] == [o.token_ids for o in plain.generate(prompts, p)]
    _only_cache_holds_segments(reuse)
