"""The quality harness's KV-compression ablations (`flashx_batch.quality.ablations`) and its scoring."""

import math

import pytest
import torch
import torch.nn.functional as F
from merge_support import assert_dense_path_equals_scatter

from flashx_batch import Engine
from flashx_batch.kvcache.arena import KVArena
from flashx_batch.kvcache.spec import LayerCache
from flashx_batch.quality.ablations import (
    POLICIES,
    choose_groups,
    plan_score_weighted,
    plan_streaming,
    random_compression,
)
from flashx_batch.runtime.kv_merge import (
    GROUP,
    MergeSettings,
    apply_plan,
    choose_compression,
    compressed_length,
    plan_groups,
)


def _attend(q, arena, length):
    k, v = arena.flat(0)
    return F.scaled_dot_product_attention(q, k[:length].transpose(0, 1)[None], v[:length].transpose(0, 1)[None],
                                          attn_mask=arena.bias[:length][None, None, None, :])


def test_duplicate_oracle_holds_for_score_weighted_merges():
    """Duplicates receive equal attention, so a score-weighted merge is exact too (bias log 4)."""
    torch.manual_seed(1)
    length, heads, dim = 64, 2, 16
    arena = KVArena((LayerCache("kv", 2, heads, dim),), length, torch.float32, torch.device("cpu"))
    arena.storage[0, :, :length] = torch.randn(2, length // GROUP, heads, dim).repeat_interleave(GROUP, dim=1)
    q = torch.randn(1, heads, 3, dim)
    full = _attend(q, arena, length)
    scores = torch.rand(length // GROUP).repeat_interleave(GROUP)  # equal within each group
    used = apply_plan(arena, 0, length, 0, plan_score_weighted(length, list(range(1, 12)), scores))
    assert torch.allclose(full, _attend(q, arena, used), atol=1e-5)
    assert arena.bias[4].item() == pytest.approx(math.log(4))


def test_score_weighted_merge_leans_to_the_attended_token():
    scores = torch.ones(16)
    scores[8:12] = torch.tensor([0.1, 0.8, 0.05, 0.05])  # group 2: one token holds most of the attention
    plan = plan_score_weighted(16, [2], scores, sharpness=5.0)
    weights = plan.weight[8:12]
    assert weights.sum().item() == pytest.approx(1.0) and weights.argmax().item() == 1 and weights[1] > 0.99
    slot = plan.target[8].item()
    assert plan.positions[slot] == pytest.approx(9.0, abs=0.02)  # rotated to where its weight sits
    effective = (0.1 + 0.8 + 0.05 + 0.05) / 0.8
    assert plan.log_counts()[slot].item() == pytest.approx(math.log(effective))  # weighs as ~1.25 tokens, not 4
    assert plan_groups(16, [2]).log_counts()[slot].item() == pytest.approx(math.log(4))  # equal weights: 4
    flat = plan_score_weighted(16, [2], scores, sharpness=1.0).weight[8:12]
    assert flat.tolist() == pytest.approx([0.1, 0.8, 0.05, 0.05])
    # the slots and counts are the equal-weight plan's
    same = plan_groups(16, [2])
    assert torch.equal(plan.target, same.target) and plan.counts == same.counts


def test_ablation_group_choices():
    s = MergeSettings(fraction=0.5, sinks=4, window=8, evict_share=0.0)
    scores = torch.arange(40, dtype=torch.float32)  # later tokens matter more
    assert choose_groups(scores, 40, s, "merge") == [1, 2, 3, 4]
    assert choose_groups(scores, 40, s, "evict") == [1, 2, 3, 4]
    # one dominant token: merging keeps it (little is lost), evicting loses it (a lot is lost)
    peaked = torch.full((40,), 2.0)
    peaked[8], peaked[9:12] = 50.0, 0.5  # group 2: one dominant token, three quiet ones
    assert choose_groups(peaked, 40, s, "merge", count=1) == [2]
    assert 2 not in choose_groups(peaked, 40, s, "evict")
    assert len(choose_groups(scores, 40, s, "random", seed=3)) == 4
    with pytest.raises(ValueError, match="not evict, merge or random"):
        choose_groups(scores, 40, s, "sum")
    stream = plan_streaming(40, keep=20, sinks=4)
    assert stream.num_slots == 20 and stream.target[39] == 19 and stream.target[10] == -1
    # random groups at segment_sparse's counts
    s = MergeSettings(fraction=0.5, sinks=4, window=8, evict_share=0.8)
    merge, evict = random_compression(40, s, seed=2)
    assert (len(merge), len(evict)) == (1, 2) and not set(merge) & set(evict)
    assert plan_groups(40, merge, evict=evict).num_slots == compressed_length(40, s)


@pytest.mark.parametrize("rerotate", [True, False])
def test_dense_group_path_equals_the_scatter_path_for_ablation_plans(rerotate):
    """Score-weighted, evict-only and StreamingLLM plans go through the engine's dense 4:1 path;
    it must give the same cache as the general scatter-add path."""
    from flashx_batch.models.config import RopeConfig
    from flashx_batch.models.layers import RotaryTable

    torch.manual_seed(3)
    rotary = RotaryTable(RopeConfig(theta=100.0), 16, 256, torch.float32, torch.device("cpu")) if rerotate else None
    length, settings = 96, MergeSettings(fraction=0.6, sinks=4, window=8)
    scores = torch.rand(length)
    merge, evict = choose_compression(scores, length, settings)
    plans = [plan_score_weighted(length, choose_groups(scores, length, settings, "merge"), scores),
             plan_score_weighted(length, merge, scores, evict=evict),
             plan_groups(length, [], evict=merge + evict), plan_streaming(length, 40, 4)]
    assert_dense_path_equals_scatter(plans, length, rotary)


def test_quality_harness_scores_an_uncompressed_cache_as_the_reference(tiny_models):
    """`python -m flashx_batch.quality`'s core: at fraction 0 no policy compresses anything, so each
    must read as the full-cache reference; at 0.8 segment_sparse keeps fewer slots and drifts."""
    from flashx_batch.quality.kv_quality import policy_quality

    engine = Engine.from_pretrained(tiny_models["llama"][0], backend="cpu", dtype="float32", max_batch_size=4,
                                    max_input_len=96, max_output_len=1, segment_size=16, kv_observe_window=8)
    g = torch.Generator().manual_seed(11)
    windows = [torch.randint(3, 256, (57,), generator=g).tolist() for _ in range(3)]  # 48-token prompts, 8 forced
    runs = {"none": (MergeSettings(fraction=0.0, window=8), POLICIES),
            "some": (MergeSettings(fraction=0.8, window=8), ("segment_sparse",))}
    out = policy_quality(engine, windows, 48, runs)
    assert set(out["none"]) == set(POLICIES)
    for name, r in out["none"].items():
        assert r["kv_bytes_ratio"] == 1.0 and r["mean_kl"] < 1e-6 and r["top1_agreement"] >= 0.95, name
    compressed = out["some"]["segment_sparse"]
    assert compressed["kv_bytes_ratio"] == compressed_length(48, runs["some"][0]) / 48 < 1.0
    assert compressed["mean_kl"] > 1e-6
    with pytest.raises(ValueError, match="one window size per call"):
        policy_quality(engine, windows, 48, {"a": (MergeSettings(window=8), ()), "b": (MergeSettings(window=4), ())})
