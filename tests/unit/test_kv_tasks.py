"""The KV-compression task benchmark (`flashx_batch.quality.kv_tasks`): generators, scores, policy budgets."""

import json

import pytest
import torch

from flashx_batch.quality.kv_tasks import (
    POLICIES,
    PRESETS,
    cells_for,
    copy_examples,
    copy_score,
    main,
    mqar_examples,
    mqar_positions,
    policy_plan,
    ppl_examples,
    recall_score,
)
from flashx_batch.runtime.kv_merge import GROUP

FILLER = [list(range(100, 164)), list(range(200, 264))]
MARKER = [7, 8]


def test_copy_examples_are_deterministic_and_shaped():
    a = copy_examples(FILLER, MARKER, 4096, {0, 1, 2}, 3, span_len=16, prefix_len=4, seed=5)
    b = copy_examples(FILLER, MARKER, 4096, {0, 1, 2}, 3, span_len=16, prefix_len=4, seed=5)
    c = copy_examples(FILLER, MARKER, 4096, {0, 1, 2}, 3, span_len=16, prefix_len=4, seed=6)
    assert [(e.context, e.query, e.answer) for e in a] == [(e.context, e.query, e.answer) for e in b]
    assert a[0].context != c[0].context
    for i, ex in enumerate(a):
        prompt = ex.context + ex.query
        span = prompt[:16]
        assert prompt == span + FILLER[i % 2] + MARKER + span[:4]
        assert ex.answer == span[4:]
        assert not {0, 1, 2} & set(span)


def test_mqar_examples_are_deterministic_and_queries_ask_their_pairs():
    a = mqar_examples(FILLER, MARKER, 4096, {0, 1, 2}, 2, pairs=10, queries=4, seed=0)
    b = mqar_examples(FILLER, MARKER, 4096, {0, 1, 2}, 2, pairs=10, queries=4, seed=0)
    assert [(e.context, e.feed, e.answer) for e in a] == [(e.context, e.feed, e.answer) for e in b]
    for ex in a:
        prompt = ex.context + ex.query
        pairs = dict(zip(prompt[0:20:2], prompt[1:20:2]))
        assert len(pairs) == 10  # distinct keys
        asked = ex.feed[0::2]
        assert [pairs[k] for k in asked] == ex.answer == ex.feed[1::2]
        assert prompt[-2:] == MARKER


def test_ppl_examples_split_each_window():
    window = list(range(50))
    (ex,) = ppl_examples([window], 40)
    assert ex.context + ex.query == window[:40] and ex.answer == window[40:] and ex.feed == window[40:-1]


def test_scores_on_a_hand_made_example():
    assert copy_score([5, 6, 9, 8], [5, 6, 7, 8]) == 0.75
    assert copy_score([1, 2], [3, 4]) == 0.0
    # query [m], feed k1 v1 k2 v2: logits index 1 predicts v1 (after k1), index 3 predicts v2
    assert mqar_positions(1, 2) == [1, 3]
    predictions = torch.tensor([0, 11, 0, 99, 0])  # argmax at each position of [m, k1, v1, k2, v2]
    assert recall_score(predictions[mqar_positions(1, 2)].tolist(), [11, 22]) == 0.5


def test_cells_put_static_once():
    assert cells_for(["static", "evict_only"], [0.25, 0.5]) == [("static", 0.0), ("evict_only", 0.25),
                                                                 ("evict_only", 0.5)]


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "static"])
@pytest.mark.parametrize("saved", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("length", [256, 301])
def test_each_policy_frees_the_asked_slots(policy, saved, length):
    sinks, window = 4, 32
    scores = torch.rand(length, generator=torch.Generator().manual_seed(length))
    plan, _ = policy_plan(policy, length, saved, scores, 3, sinks, window)
    kept_tokens = int((plan.target >= 0).sum())
    assert sum(plan.counts) == kept_tokens  # every output slot stands for the tokens mapped to it
    assert plan.target[:sinks].tolist() == list(range(sinks))  # sinks kept as they are
    want = round((1 - saved) * length)
    if policy == "merge_only" and saved == 0.75:  # a 4:1 merge frees 3 of 4 slots: it cannot reach 75 %
        assert plan.num_slots == length - (GROUP - 1) * ((length - window) // GROUP - 1)  # every eligible group
    else:
        assert abs(plan.num_slots - want) <= GROUP


def test_static_has_no_plan():
    assert policy_plan("static", 100, 0.5, None, 0, 4, 32) == (None, False)
    with pytest.raises(ValueError):
        policy_plan("nonsense", 100, 0.5, torch.ones(100), 0, 4, 32)


def test_entry_point_on_the_bundled_model(tmp_path):
    """One small example per task through the compressed cache: the files are written, static scores
    itself, and the measured KV saved is the asked fraction."""
    assert main(["--out", str(tmp_path), "--samples", "1", "--mc-samples", "1", "--filler", "64",
                 "--copy-span", "8", "--mqar-pairs", "8", "--mqar-queries", "4", "--ppl-context", "96",
                 "--ppl-cont", "8", "--policies", "static,segment_sparse,evict_only,streaming",
                 "--saved", "0.5"]) == 0
    result = json.loads((tmp_path / "kv_tasks.json").read_text())
    assert set(result["tasks"]) == {"copy", "mqar", "ppl", "mc"}
    assert result["tasks"]["ppl"]["cells"]["static"]["score"] == 1.0
    for task in result["tasks"].values():
        assert task["cells"]["static"]["kv_saved"] == 0.0
        for name in ("segment_sparse@0.50", "evict_only@0.50", "streaming@0.50"):
            assert abs(task["cells"][name]["kv_saved"] - 0.5) < 0.05
    assert (tmp_path / "kv_tasks.md").exists() and (tmp_path / "kv_tasks.png").stat().st_size > 0


def test_relative_scores_put_every_task_on_higher_is_better():
    from flashx_batch.quality.kv_tasks import relative_scores

    result = {"tasks": {
        "copy": {"cells": {"static": {"score": 0.8}, "a@0.50": {"score": 0.4}}},
        "ppl": {"cells": {"static": {"score": 1.0}, "a@0.50": {"score": 1.25}}},  # policy ÷ static perplexity
        "mqar": {"cells": {"static": {"score": 0.0}, "a@0.50": {"score": 0.0}}},  # no ratio without a static score
    }}
    rel = relative_scores(result)
    assert rel["a@0.50"] == {"copy": 0.5, "ppl": 0.8, "average": pytest.approx(0.65)}
    assert rel["static"]["average"] == 1.0


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_run_the_engines_dials(preset):
    from flashx_batch.runtime.kv_merge import MergeSettings, compressed_length
    from flashx_batch.runtime.options import KV_PRESETS

    length = 400
    plan, _ = policy_plan(preset, length, 0.0, torch.rand(length), 0, 4, 32, torch.zeros(length), 6.0)
    fraction, share = KV_PRESETS[preset.split(":")[1]]
    assert plan.num_slots == compressed_length(length, MergeSettings(fraction, 4, 32, evict_share=share))
