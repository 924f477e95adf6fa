"""Segment-sparse KV: the merge is exact where it should be, lossless at fraction 0, and rolls long inputs."""

import math

import pytest
import torch
import torch.nn.functional as F
from merge_support import assert_dense_path_equals_scatter

from flashx_batch import Engine, SamplingParams
from flashx_batch.errors import ConfigError
from flashx_batch.kvcache.arena import KVArena
from flashx_batch.kvcache.spec import LayerCache
from flashx_batch.runtime.kv_merge import (
    GROUP,
    MergeSettings,
    ProtectionSearch,
    apply_plan,
    choose_compression,
    compressed_length,
    compression_counts,
    eligible_groups,
    group_sums,
    least_attended,
    max_compressed_length,
    plan_groups,
    plan_oldest,
    protect_nats_for,
)


def _attend(q, arena, length, bias=True):
    k, v = arena.flat(0)
    mask = arena.bias[:length] if bias else torch.zeros(length)
    return F.scaled_dot_product_attention(q, k[:length].transpose(0, 1)[None], v[:length].transpose(0, 1)[None],
                                          attn_mask=mask[None, None, None, :])


def test_duplicate_oracle():
    """Groups of 4 identical tokens merged 4:1 with the log-count bias attend exactly as before; the
    bias is what makes it exact."""
    torch.manual_seed(0)
    length, heads, dim = 64, 2, 16
    arena = KVArena((LayerCache("kv", 2, heads, dim),), num_slots=64, dtype=torch.float32,
                    device=torch.device("cpu"))
    groups = torch.randn(2, length // GROUP, heads, dim)
    arena.storage[0, :, :length] = groups.repeat_interleave(GROUP, dim=1)  # every group: 4 identical K/V
    q = torch.randn(1, heads, 3, dim)
    full = _attend(q, arena, length)
    merge = [g for g in range(1, 12)]  # 11 of 16 groups
    used = apply_plan(arena, 0, length, 0, plan_groups(length, merge))
    assert used == length - 3 * len(merge)
    assert torch.allclose(full, _attend(q, arena, used), atol=1e-5)
    assert not torch.allclose(full, _attend(q, arena, used, bias=False), atol=1e-5)
    assert arena.bias[3].item() == 0.0 and arena.bias[4].item() == pytest.approx(math.log(4))


def test_plans_and_counts():
    s = MergeSettings(fraction=0.5, sinks=4, window=8, evict_share=0.0)  # merge only
    assert eligible_groups(40, s) == list(range(1, 8))
    scores = torch.arange(40, dtype=torch.float32)  # later tokens matter more
    assert least_attended(scores, 40, s, 4) == [1, 2, 3, 4]
    peaked = torch.full((40,), 2.0)
    peaked[8], peaked[9:12] = 50.0, 0.5  # group 2: one dominant token, three quiet ones
    assert 2 not in least_attended(peaked, 40, s, 4)
    assert compressed_length(40, s) == 28
    evict = plan_groups(40, [], evict=[1, 2])
    assert evict.num_slots == 32 and (evict.target[4:12] == -1).all()
    rolled = plan_oldest([1] * 40, [float(i) for i in range(40)], 12, s)
    assert rolled.num_slots == 28 and rolled.counts[4:8] == [4, 4, 4, 4] and sum(rolled.counts) == 40
    assert rolled.positions[4:6] == [5.5, 9.5]  # tokens 4..7 and 8..11 folded, each at its mean position
    twice = plan_oldest(rolled.counts, rolled.positions, 9, s)
    assert twice.counts[4] == 16 and sum(twice.counts) == 40


def test_segment_sparse_evicts_the_least_attended_groups_and_merges_the_next():
    s = MergeSettings(fraction=0.5, sinks=4, window=8, evict_share=0.8)
    assert eligible_groups(40, s) == list(range(1, 8))
    # 4 groups' worth of merging frees 12 slots: 2 groups evicted (8 slots) + 1 merged (3) is the nearest split
    assert compression_counts(40, s) == (1, 2)
    scores = torch.arange(40, dtype=torch.float32)  # later tokens matter more
    assert choose_compression(scores, 40, s) == ([3], [1, 2])
    plan = plan_groups(40, [3], evict=[1, 2])
    assert plan.num_slots == compressed_length(40, s) == 29
    assert (plan.target[4:12] == -1).all() and len(set(plan.target[12:16].tolist())) == 1  # 12..15: one slot
    assert plan.target[3].item() == 3 and plan.target[16].item() == 5 and plan.counts[4] == GROUP
    # the ends of the dial: merge only and evict only
    assert choose_compression(scores, 40, MergeSettings(0.5, 4, 8, evict_share=0.0)) == ([1, 2, 3, 4], [])
    assert choose_compression(scores, 40, MergeSettings(0.5, 4, 8, evict_share=1.0)) == ([], [1, 2, 3])
    # ranked by the attention a group received: a group with one spike is kept whole, not evicted
    # (ranking merges by sum - max, as merge-only does, would evict it first)
    spiked = scores.clone()
    spiked[8:12] = torch.tensor([100.0, 0.5, 0.5, 0.5])
    # ... and so is the group after it (copying needs the tokens that follow an attended match)
    assert choose_compression(spiked, 40, s) == ([5], [1, 4])
    with pytest.raises(ValueError, match="both merged and evicted"):
        plan_groups(40, [2, 3], evict=[3])


def test_the_stripe_holds_every_prompt_length_once_compressed():
    """Rounding group counts can leave a shorter prompt longer once compressed: the arena sizes
    stripes from the maximum over every length, not from the longest prompt's."""
    s = MergeSettings(fraction=0.8, sinks=4, window=32, evict_share=0.8)
    limit = 512
    assert max_compressed_length(limit, s) >= max(compressed_length(n, s) for n in range(1, limit + 1))
    assert max_compressed_length(limit, s) > compressed_length(limit, s)  # 230 (at 511) vs 227


def test_the_evict_share_reaches_the_engine_and_the_job_fingerprint(tiny_models):
    from types import SimpleNamespace

    from flashx_batch.config import JobConfig
    from flashx_batch.runner.fingerprint import compute

    engine = _engine(tiny_models["llama"][0], cache_policy="segment_sparse", kv_evict_share=0.3)
    assert engine.merge.evict_share == 0.3
    job = JobConfig()
    assert "runtime.kv_evict_share" not in compute(job, SimpleNamespace(files=[]), {})  # static jobs resume as before
    job.runtime.cache_policy, job.runtime.kv_evict_share = "segment_sparse", 0.5
    assert compute(job, SimpleNamespace(files=[]), {})["runtime.kv_evict_share"] == 0.5
    assert job.engine_options().kv_evict_share == 0.5


def test_presets_set_both_dials_and_an_explicit_value_overrides_its_own():
    from types import SimpleNamespace

    from flashx_batch.config import JobConfig
    from flashx_batch.runner.fingerprint import compute
    from flashx_batch.runtime.options import KV_PRESETS, EngineOptions

    for name, (fraction, share) in KV_PRESETS.items():
        o = EngineOptions(cache_policy="segment_sparse", kv_preset=name)
        assert (o.merge_fraction, o.evict_share) == (fraction, share)
    o = EngineOptions(kv_preset="aggressive", kv_evict_share=0.0)
    assert (o.merge_fraction, o.evict_share) == (KV_PRESETS["aggressive"][0], 0.0)
    # aggressive frees more than balanced: its stripes are shorter
    lengths = {name: compressed_length(512, MergeSettings(f, evict_share=e)) for name, (f, e) in KV_PRESETS.items()}
    assert lengths["aggressive"] < lengths["balanced"] < 512
    with pytest.raises(ConfigError, match="kv_preset='fast' is not one of balanced, aggressive"):
        EngineOptions(kv_preset="fast")
    # the fingerprint holds the resolved dials: a preset and its values spelled out resume each other
    named, spelled = JobConfig(), JobConfig()
    for job in (named, spelled):
        job.runtime.cache_policy = "segment_sparse"
    spelled.runtime.kv_merge_fraction, spelled.runtime.kv_evict_share = KV_PRESETS["balanced"]
    plan = SimpleNamespace(files=[])
    assert compute(named, plan, {}) == compute(spelled, plan, {})
    spelled.runtime.kv_preset = "aggressive"  # the explicit values win over the preset's: same dials
    assert compute(named, plan, {}) == compute(spelled, plan, {})
    named.runtime.kv_preset = "aggressive"
    assert compute(named, plan, {}) != compute(spelled, plan, {})


def test_surprising_groups_are_kept_even_when_the_window_ignores_them():
    """A query that arrives after compression (the next question about a prompt) is invisible to the
    window's attention; groups as unpredictable as random vocabulary (a random string in predictable
    text) are protected. Attention alone would compress them first."""
    length = 96
    protect = protect_nats_for(4096)
    s = MergeSettings(fraction=0.5, sinks=4, window=16, evict_share=0.5, protect_nats=protect)
    scores = torch.linspace(1.0, 2.0, length)  # the window prefers recent tokens a little
    surprisal = torch.full((length,), 2.0)
    surprisal[8:24] = math.log(4096)  # groups 2..5: a random string the model could not predict
    surprisal[40:44] = protect - 0.5  # group 10: surprising, but below the bar
    merge, evict = choose_compression(scores, length, s, surprisal)
    assert not {2, 3, 4, 5} & set(merge + evict)
    assert 10 in merge + evict
    merge, evict = choose_compression(scores, length, MergeSettings(0.5, 4, 16, evict_share=0.5), surprisal)
    assert {2, 3, 4, 5} <= set(merge + evict)  # attention only
    # a budget larger than the unprotected groups gives up the least surprising protected ones first
    many = surprisal.clone()
    for g in range(2, 9):  # groups 2..8 protected, group 8 the most surprising
        many[4 * g : 4 * g + 4] = math.log(4096) + 0.1 * g
    many[36:40] = protect + 0.1  # group 9 just over the bar
    greedy = MergeSettings(1.0, 4, 16, evict_share=1.0, protect_nats=protect)
    merge, evict = choose_compression(scores, length, greedy, many)
    assert len(evict) > len(eligible_groups(length, greedy)) - 8  # more than the unprotected groups
    assert 9 in evict and 8 not in evict and set(range(10, 20)) <= set(evict)
    # among unprotected groups, an attended group and the one after it are kept
    scores[60:64] = 50.0
    merge, evict = choose_compression(scores, length, s, surprisal)
    assert not {15, 16} & set(merge + evict)  # group 15 and the one after it (what copying reads next)


def _plan_from_every_group(scores, surprisal, length, s):
    """The segment-sparse plan written the direct way: every eligible group's worth (attention rank,
    or 1 + surprisal rank when protected), the least valuable evicted, the next merged."""
    merged, evicted = compression_counts(length, s)
    groups = eligible_groups(length, s)
    if merged + evicted == 0:
        return [], []
    attention = torch.stack([scores[4 * g : 4 * g + 4].sum() for g in groups])
    attention = torch.maximum(attention, torch.cat((attention[:1], attention[:-1])))
    rank = lambda v: torch.argsort(torch.argsort(v, stable=True), stable=True).float()  # noqa: E731
    worth = rank(attention) / len(groups)
    info = torch.stack([surprisal[4 * g : 4 * g + 4].sum() for g in groups])
    protected = info >= 4 * s.protect_nats
    if protected.any():
        worth[protected] = 2.0 + rank(info[protected])
    order = [groups[i] for i in torch.argsort(worth, stable=True)[: merged + evicted].tolist()]
    return sorted(order[evicted:]), sorted(order[:evicted])


def _search_rounds(scores: torch.Tensor, surprisal: torch.Tensor, length: int, s: MergeSettings):
    """Run a search to its plan, feeding each round from `surprisal`; the plan must be the one every
    group's surprisal gives. -> (the search, the size of each round)."""
    search, sizes = ProtectionSearch(scores, length, s), []
    while wanted := search.wanted():
        sizes.append(len(wanted))
        search.feed(wanted, group_sums(surprisal, wanted))
    assert search.plan() == _plan_from_every_group(scores, surprisal, length, s)
    return search, sizes


@pytest.mark.parametrize("seed", range(12))
def test_protection_search_asks_for_few_groups_and_plans_as_if_it_knew_all(seed):
    """The production plan asks for the surprisal of the groups it would compress (and a few
    more), round after round while protected groups push the cut further up; the plan is the one
    every group's surprisal gives — here against the direct computation, on prompts where none, a
    few, or most groups are protected."""
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(40, 400, (1,), generator=g))
    protect = protect_nats_for(4096)
    s = MergeSettings(fraction=[0.3, 0.6, 0.9, 1.0][seed % 4], sinks=4, window=16,
                      evict_share=[0.0, 0.8, 1.0][seed % 3], protect_nats=protect)
    scores = torch.rand(length, generator=g)
    share = [0.0, 0.05, 0.3, 0.9][seed % 4]  # of groups made as unpredictable as random vocabulary
    surprisal = torch.rand(length, generator=g) * 4
    for group in range(length // 4):
        if torch.rand(1, generator=g) < share:
            surprisal[4 * group : 4 * group + 4] = math.log(4096) + torch.rand(4, generator=g)
    search, sizes = _search_rounds(scores, surprisal, length, s)  # checks the plan against every group's
    assert search.plan() == choose_compression(scores, length, s, surprisal)
    asked = sum(sizes)
    merged, evicted = compression_counts(length, s)
    if share == 0.0:  # nothing protected: one round, the groups compressed and a few more
        assert asked <= merged + evicted + ProtectionSearch.slack(merged + evicted)
    fresh = ProtectionSearch(scores, length, s)
    if fresh.wanted():  # a plan before the surprisal it needs is a caller's bug, not a guess
        with pytest.raises(ValueError, match="wanted"):
            fresh.plan()


def test_packed_prefill_surprisal_is_the_models_next_token_loss(llama_dir):
    """The per-token surprisal segment-sparse ranks groups with is -log p from a plain forward, row by
    row, for rows packed end to end."""
    engine = _engine(llama_dir, cache_policy="segment_sparse")
    runner = engine.runner
    prompts = _prompts((40, 17, 33))
    starts = [0, 64, 128]
    _, _, kept = runner.passes.prefill_packed_at(prompts, starts, keep_final=True)
    probe = runner.scorer.probe(kept)
    surprisal = probe.tokens([torch.arange(len(p)) for p in prompts])
    # asked for a few tokens, out of order: the same numbers as asking for all of them
    some = [torch.tensor([9, 3, 0, 39]), torch.tensor([], dtype=torch.long), torch.tensor([16, 1])]
    for got, want_at, everything in zip(probe.tokens(some), some, surprisal):
        assert torch.allclose(got, everything[want_at], atol=1e-5)
    for prompt, got in zip(prompts, surprisal):
        logits = runner.score([prompt])[0]
        want = -torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert got[0] == 0.0 and len(got) == len(prompt)
        # the LM head runs in bfloat16 on a float32 CPU model: a ranking signal, close, not exact
        assert torch.allclose(got[1:], want, rtol=0.02, atol=0.05)
        assert torch.equal(runner.prompt_surprisal(prompt), got)  # the harness's path, the same numbers


def test_packed_surprisal_of_rows_sharing_lengths_interleaved(llama_dir):
    """Rows of one length share one attention call (their asked-for queries padded to the most any of
    them asks), and rows of other lengths sit between them in the pack: every row's surprisal is still
    the plain forward's, bit for bit, whichever of its tokens are asked for."""
    engine = _engine(llama_dir, cache_policy="segment_sparse", max_batch_size=8)
    runner = engine.runner
    prompts = _prompts((40, 17, 40, 33, 17, 40))
    starts = [0, 48, 96, 144, 192, 240]
    _, _, kept = runner.passes.prefill_packed_at(prompts, starts, keep_final=True)
    probe = runner.scorer.probe(kept)
    every = probe.tokens([torch.arange(len(p)) for p in prompts])
    some = [torch.arange(0, 40, 3), torch.tensor([16]), torch.tensor([38, 5]),
            torch.tensor([32, 1, 20]), torch.arange(17), torch.tensor([0])]
    for prompt, got, want_at, asked in zip(prompts, every, some, probe.tokens(some), strict=True):
        assert torch.equal(got, runner.prompt_surprisal(prompt))
        assert torch.equal(asked, got[want_at])


def test_protection_search_asks_for_the_shortfall_not_every_group_left():
    """Text with a name or a number every few groups (one group in seven protected): after the first
    round the search asks for about what is still missing, scaled by how many asked groups came
    back unprotected — not for every group that is left."""
    length = 512
    s = MergeSettings(fraction=0.6, sinks=4, window=32, evict_share=0.8, protect_nats=protect_nats_for(4096))
    scores = torch.rand(length, generator=torch.Generator().manual_seed(0))
    surprisal = torch.full((length,), 2.0)
    for group in range(0, length // 4, 7):
        surprisal[4 * group : 4 * group + 4] = math.log(4096)
    search, sizes = _search_rounds(scores, surprisal, length, s)
    assert len(sizes) <= 3 and sum(sizes) <= 1.4 * search.need < len(search.order), (sizes, search.need)


@pytest.mark.parametrize("length", [512, 2048])
def test_protection_search_crosses_a_protected_band_in_few_rounds(length):
    """The groups just past the first round's cut all protected (a table of ids the window barely
    looked at): later rounds grow geometrically, so the band costs a handful of rounds, not one
    round per few groups."""
    s = MergeSettings(fraction=0.5, sinks=4, window=32, evict_share=0.8, protect_nats=protect_nats_for(4096))
    scores = torch.rand(length, generator=torch.Generator().manual_seed(0))
    search = ProtectionSearch(scores, length, s)
    order, first = search.order, search.wanted()
    surprisal = torch.full((length,), 2.0)
    # the first round's spare groups and one more protected (one group short after it), then the band
    band = order[: ProtectionSearch.slack(search.need) + 1] + order[len(first) : len(first) + len(order) // 4]
    for group in band:
        surprisal[4 * group : 4 * group + 4] = math.log(4096)
    _, sizes = _search_rounds(scores, surprisal, length, s)
    assert len(sizes) <= 2 + math.ceil(math.log2(len(order))), sizes


@pytest.mark.parametrize("share", [0.0, 0.3, 0.8, 1.0])
def test_compressed_length_is_what_the_plan_keeps(share):
    """The arena sizes stripes from compressed_length: every prompt length's plan must keep exactly that."""
    s = MergeSettings(fraction=0.7, sinks=4, window=8, evict_share=share)
    for n in range(1, 130):
        scores = torch.rand(n, generator=torch.Generator().manual_seed(n))
        merge, evict = choose_compression(scores, n, s)
        assert not set(merge) & set(evict) and set(merge + evict) <= set(eligible_groups(n, s))
        assert plan_groups(n, merge, evict=evict).num_slots == compressed_length(n, s), n


@pytest.fixture(scope="module")
def llama_dir(tiny_models):
    return tiny_models["llama"][0]


def _engine(model_dir, **kw):
    opts = dict(backend="cpu", dtype="float32", max_batch_size=4, max_input_len=96, max_output_len=16,
                segment_size=16)
    opts.update(kw)
    return Engine.from_pretrained(model_dir, **opts)


def _prompts(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "glm4"])
def test_fraction_zero_is_token_identical_to_static(arch, tiny_models):
    model_dir = tiny_models[arch][0]
    prompts = _prompts((90, 40, 64, 7, 55))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    static = _engine(model_dir).generate(prompts, params)
    sparse = _engine(model_dir, cache_policy="segment_sparse", kv_merge_fraction=0.0).generate(prompts, params)
    assert [o.token_ids for o in static] == [o.token_ids for o in sparse]


def test_segment_sparse_admits_more_rows_and_keeps_the_arena_whole(llama_dir):
    static = _engine(llama_dir)
    sparse = _engine(llama_dir, cache_policy="segment_sparse", kv_merge_fraction=0.8, kv_observe_window=8)
    assert sparse.runner.arena.nbytes <= static.runner.arena.nbytes
    assert sparse.admitted_batch_size > static.admitted_batch_size
    prompts = _prompts((96,) * 6)
    outs = sparse.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (16, 3, 16, 1, 9, 16)])
    assert [o.num_generated_tokens for o in outs] == [16, 3, 16, 1, 9, 16]
    assert sparse.last_stats.batches == 1 and sparse.last_stats.kv_bytes_peak < sparse.last_stats.kv_bytes_static_peak
    assert sparse.scheduler.allocator.is_whole()
    # the first generated token comes from the uncompressed prefill: always equal to static's
    first = static.generate(prompts[:1], SamplingParams(max_new_tokens=1))[0].token_ids
    assert outs[0].token_ids[:1] == first


def test_rolling_merge_completes_a_prompt_three_times_max_input_len(llama_dir):
    engine = _engine(llama_dir, long_input="rolling_merge", kv_observe_window=8)
    long_prompt = _prompts((3 * 96,))[0]
    out = engine.generate([long_prompt, long_prompt[:50]], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert out[0].num_input_tokens == 3 * 96 and out[0].num_generated_tokens == 16
    assert engine.scheduler.allocator.is_whole()
    reference = _engine(llama_dir).generate([long_prompt[:50]], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert out[1].token_ids == reference[0].token_ids  # a short row in the same batch is unaffected
    # the long row's tokens are its own, not its batch's: the same alone
    alone = engine.generate([long_prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert out[0].token_ids == alone.token_ids


def test_merged_keys_are_averaged_before_rope_and_rotated_to_the_mean_position():
    from flashx_batch.models.config import RopeConfig
    from flashx_batch.models.layers import RotaryTable

    torch.manual_seed(1)
    rotary = RotaryTable(RopeConfig(theta=100.0), 16, 64, torch.float32, torch.device("cpu"))
    arena = KVArena((LayerCache("kv", 2, 2, 16),), num_slots=16, dtype=torch.float32,
                    device=torch.device("cpu"))
    raw = torch.randn(1, 2, 16)  # one pre-RoPE key, seen at positions 0..15
    arena.storage[0, 0, :16] = rotary.rotate(raw.expand(16, 2, 16).clone(), torch.arange(16.0))
    plan = plan_groups(16, [2])  # tokens 8..11 -> one slot at position 9.5
    apply_plan(arena, 0, 16, 0, plan, rotary=rotary)
    expected = rotary.rotate(raw.clone(), torch.tensor([9.5]))[0]
    assert torch.allclose(arena.storage[0, 0, 8], expected, atol=1e-5)
    assert torch.equal(arena.storage[0, 0, 9], rotary.rotate(raw.clone(), torch.tensor([12.0]))[0])  # token 12: as is


def test_a_moved_row_does_not_inherit_the_finished_rows_merge_bias(llama_dir):
    """Segment-sparse batch: a long row finishes first, the short row moves into its stripe; its
    new tokens must not be attended with the long row's leftover log-count bias."""
    engine = _engine(llama_dir, cache_policy="segment_sparse", kv_observe_window=8)
    long_row, short_row = _prompts((96, 20), seed=8)
    params = [SamplingParams(max_new_tokens=1, ignore_eos=True), SamplingParams(max_new_tokens=16, ignore_eos=True)]
    together = engine.generate([long_row, short_row], params)
    alone = engine.generate([short_row], params[1:])
    assert together[1].token_ids == alone[0].token_ids


def test_evict_only_rows_decode_without_a_mask_and_the_same_tokens(llama_dir, monkeypatch):
    """Evicting leaves no merge bias, so aligned rows step with no mask at all; a bias in the arena
    (a merge) brings the mask back, and the tokens do not change."""
    from flashx_batch.runtime.forward_passes import ForwardPasses

    engine = _engine(llama_dir, cache_policy="segment_sparse", kv_observe_window=8)
    prompts, params = _prompts((96,) * 4, seed=11), SamplingParams(max_new_tokens=16, ignore_eos=True)
    masks = []
    original = ForwardPasses.stripe_mask
    monkeypatch.setattr(ForwardPasses, "stripe_mask", lambda self, *a: masks.append(a) or original(self, *a))
    unmasked = engine.generate(prompts, params)
    assert engine.last_stats.kv_bytes_peak < engine.last_stats.kv_bytes_static_peak  # the rows were compressed
    assert not engine.runner.arena.has_merge_bias and not masks
    engine.runner.arena.has_merge_bias = True  # as a merge would leave it
    masked = engine.generate(prompts, params)
    assert masks and [o.token_ids for o in unmasked] == [o.token_ids for o in masked]


def test_a_merge_marks_the_arena_as_holding_merge_bias(llama_dir):
    engine = _engine(llama_dir, cache_policy="segment_sparse", kv_observe_window=8, kv_evict_share=0.5)
    engine.generate(_prompts((96,) * 2), SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert engine.runner.arena.has_merge_bias and bool((engine.runner.arena.bias > 0).any())


def test_stripes_hold_every_prompt_length_at_awkward_fractions(llama_dir):
    """Rounding the merge count can leave a shorter prompt longer once merged; the stripe must fit it."""
    engine = _engine(llama_dir, cache_policy="segment_sparse", kv_merge_fraction=0.4, max_input_len=64,
                     max_output_len=9, kv_observe_window=8)
    prompt = _prompts((63,))[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=9, ignore_eos=True))[0]
    assert out.num_generated_tokens == 9 and engine.scheduler.allocator.is_whole()
    # the first token comes from the uncompressed prefill: the static cache's; the rest fit the stripe
    static = _engine(llama_dir, max_input_len=64, max_output_len=9)
    assert out.token_ids[:1] == static.generate([prompt], SamplingParams(max_new_tokens=1))[0].token_ids
    assert engine.last_stats.kv_bytes_peak < engine.last_stats.kv_bytes_static_peak  # merged, not kept whole
    with pytest.raises(ConfigError, match="longer than a row"):
        engine.score([[5] * (engine.geometry.row_capacity + 1)])


@pytest.mark.parametrize("rerotate", [True, False])
def test_dense_group_path_equals_the_scatter_path(rerotate):
    """`apply_plan` reduces 4:1 groups densely; the general scatter-add path must give the same cache."""
    from flashx_batch.models.config import RopeConfig
    from flashx_batch.models.layers import RotaryTable

    torch.manual_seed(3)
    rotary = RotaryTable(RopeConfig(theta=100.0), 16, 256, torch.float32, torch.device("cpu")) if rerotate else None
    length, settings = 96, MergeSettings(fraction=0.6, sinks=4, window=8)
    scores = torch.rand(length)
    merge, evict = choose_compression(scores, length, settings)
    plans = [plan_groups(length, merge, evict=evict), plan_groups(length, [2, 5, 6]),
             plan_groups(length, [], evict=[3, 4]),
             plan_oldest([1] * length, [float(i) for i in range(length)], 30, settings)]
    assert_dense_path_equals_scatter(plans, length, rotary)


def test_packed_merged_fill_equals_filling_row_by_row(llama_dir, monkeypatch):
    """Segment-sparse rows are prefilled several at a time, staged at the end of the free space, then
    merged down in stripe order; outputs must equal prefilling and merging each row alone. (Exact
    tokens rely on CPU float32 sgemm giving the same window scores for a packed and a lone row, as it
    does here; another BLAS could flip a near-tie between two groups.)"""
    from flashx_batch.runtime.compressed_prefill import CompressedPrefill, staged_rows

    engine = _engine(llama_dir, cache_policy="segment_sparse", kv_observe_window=8)
    prompts = _prompts((96, 20, 71, 96, 33, 90, 12, 64, 96, 50, 81))
    params = [SamplingParams(max_new_tokens=3 + (5 * i) % 14, ignore_eos=True) for i in range(len(prompts))]
    runner, cap = engine.runner, engine.geometry.row_capacity
    lengths = [len(p) for p in prompts]
    assert staged_rows(0, runner.arena.num_slots, cap, lengths) > 1  # rows do share a prefill
    packed = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.scheduler.allocator.is_whole()

    def one_by_one(self, first, capacity, rows):  # each row prefilled alone in its own region, merged in place
        logits, used = [], []
        for i, prompt in enumerate(rows):
            start = (first + i) * capacity
            last, scores = self.passes.extend(prompt, start, 0, 0, observe=self.merge.window)
            merge, evict = choose_compression(scores, len(prompt), self.merge, self.scorer.prompt_surprisal(prompt))
            plan = plan_groups(len(prompt), merge, evict=evict)
            used.append(apply_plan(self.passes.arena, start, len(prompt), start, plan, rotary=self.rotary(self.merge)))
            logits.append(last[-1])
        return torch.stack(logits), used

    monkeypatch.setattr(CompressedPrefill, "fill_merged", one_by_one)
    assert packed == [o.token_ids for o in engine.generate(prompts, params)]


def test_staged_rows_keep_each_merge_clear_of_the_rows_still_staged():
    from flashx_batch.runtime.compressed_prefill import staged_rows

    # 2 stripes of 100 slots + 50 spare; prompts staged at the end, row 0 merges into [0, 100)
    assert staged_rows(0, 250, 100, [60, 150]) == 2  # row 1 staged from slot 100: clear of row 0's stripe
    assert staged_rows(0, 250, 100, [60, 160]) == 1  # row 1 would start at slot 90, inside row 0's stripe
    assert staged_rows(0, 250, 100, [150, 150]) == 1  # 300 tokens do not fit 250 slots
    assert staged_rows(0, 416, 80, [96] * 5) == 4


def test_an_over_long_row_among_segment_sparse_rows_leaves_theirs_unchanged(llama_dir):
    """Rows that fit are packed in runs around an over-long row, which rolls alone in its stripe."""
    engine = _engine(llama_dir, cache_policy="segment_sparse", long_input="rolling_merge", kv_observe_window=8,
                     sort_by_length=False)  # keep the long row in the middle of the batch
    short = _prompts((60, 90, 33, 75), seed=9)
    long_prompt = _prompts((2 * 96 + 17,), seed=10)[0]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    mixed = engine.generate(short[:2] + [long_prompt] + short[2:], params)
    assert mixed[2].num_input_tokens == len(long_prompt) and mixed[2].num_generated_tokens == 6
    alone = engine.generate(short, params)
    assert [o.token_ids for o in mixed[:2] + mixed[3:]] == [o.token_ids for o in alone]
    assert engine.scheduler.allocator.is_whole()
