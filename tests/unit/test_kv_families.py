"""The tuning / held-out task families for lossy KV settings (`quality.kv_families`) and the retention report."""

import json
import math
import random

import pytest

from flashx_batch.quality import kv_families as fam
from flashx_batch.quality.kv_tasks import main, policy_plan
from flashx_batch.quality.kv_tasks_report import retention

FILLER = [list(range(100, 164)), list(range(200, 264))]
AVOID = {0, 1, 2}


def test_splits_share_no_family_and_differ_in_format():
    tuning, held = set(fam.SPLITS["tuning"]), set(fam.SPLITS["held_out"])
    assert not tuning & held and "mc" in held and "copy" in tuning


def test_multikey_recall_asks_each_value_after_its_keys_last_token():
    examples = fam.multikey_examples(FILLER, [7], 4096, AVOID, 2, pairs=6, queries=3, seed=1)
    for ex in examples:
        prompt = ex.context + ex.query
        stored = prompt[: 6 * (fam.KEY_TOKENS + 1)]
        pairs = {tuple(stored[i : i + fam.KEY_TOKENS]): stored[i + fam.KEY_TOKENS]
                 for i in range(0, len(stored), fam.KEY_TOKENS + 1)}
        assert len({k[0] for k in pairs}) == 6  # keys differ in their first token
        sequence = ex.query + ex.feed
        for value, at in zip(ex.answer, ex.positions, strict=True):
            key = tuple(sequence[at - fam.KEY_TOKENS + 1 : at + 1])
            assert pairs[key] == value and sequence[at + 1] == value  # the logit at `at` predicts the value


def test_multihop_asks_a_chain_whose_two_links_are_stored_apart():
    ex = fam.multihop_examples(FILLER, [7, 8], 4096, AVOID, 1, seed=3)[0]
    prompt = ex.context + ex.query
    a, (b, c) = prompt[-1], ex.answer
    stored = prompt[: -3]  # pairs, filler, pairs; then the marker and a
    links = {(stored[i], stored[i + 1]) for i in range(len(stored) - 1)}
    assert (a, b) in links and (b, c) in links and len({a, b, c}) == 3


def test_the_needle_sits_inside_the_text_and_its_cue_is_its_start():
    for ex in fam.needle_examples(FILLER, [7, 8], 4096, AVOID, 4, seed=0):
        prompt = ex.context + ex.query
        cue = prompt[-fam.NEEDLE_CUE :]
        span = cue + ex.answer
        text_len = len(prompt) - fam.NEEDLE_TOKENS - 2 - fam.NEEDLE_CUE
        start = next(i for i in range(len(prompt)) if prompt[i : i + fam.NEEDLE_TOKENS] == span)
        assert text_len // 10 <= start <= 9 * text_len // 10


def test_paired_bootstrap_brackets_the_ratio_and_is_exact_when_equal():
    rng = random.Random(0)
    static = [rng.random() for _ in range(40)]
    kept, lo, hi = fam.paired_bootstrap(static, static)
    assert kept == lo == hi == 1.0
    half = [s / 2 for s in static]
    kept, lo, hi = fam.paired_bootstrap(half, static)
    assert kept == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    noisy = [s * rng.choice([0.0, 1.0]) for s in static]
    kept, lo, hi = fam.paired_bootstrap(noisy, static)
    assert lo < kept < hi and 0.2 < kept < 0.8
    # resamples where static scored nothing have no ratio: left out of the interval, not counted as huge
    sparse_static = [1.0] + [0.0] * 9
    kept, lo, hi = fam.paired_bootstrap([0.5] + [0.0] * 9, sparse_static, resamples=200)
    assert kept == lo == hi == 0.5
    # lower is better (per-example mean NLL): retention = static perplexity ÷ the policy's
    kept, _, _ = fam.paired_bootstrap([2.1] * 5, [2.0] * 5, lower_is_better=True)
    assert kept == pytest.approx(math.exp(-0.1))


def test_retention_skips_families_static_cannot_score():
    result = {"tasks": {
        "needle": {"cells": {"static": {"per_example": [0.0, 0.0], "kv_saved": 0.0},
                             "p": {"per_example": [0.0, 0.0], "kv_saved": 0.5}}},
        "copy_long": {"cells": {"static": {"per_example": [1.0, 0.5], "kv_saved": 0.0},
                                "p": {"per_example": [0.5, 0.25], "kv_saved": 0.5}}}}}
    kept = retention(result, resamples=50)
    assert set(kept["p"]) == {"copy_long"} and kept["p"]["copy_long"]["retention"] == pytest.approx(0.5)


def test_held_out_split_on_the_bundled_model(tmp_path):
    """`--split held_out` runs exactly the held-out families, and the report carries each preset's retention
    with its interval and the KV it saved on the same examples."""
    assert main(["--out", str(tmp_path), "--split", "held_out", "--samples", "2", "--mc-samples", "2",
                 "--filler", "64", "--copy-span", "8", "--mqar-pairs", "8", "--mqar-queries", "4",
                 "--policies", "static,preset:balanced", "--saved", "0.5"]) == 0
    result = json.loads((tmp_path / "kv_tasks.json").read_text())
    assert tuple(result["tasks"]) == fam.SPLITS["held_out"] and result["split"] == "held_out"
    for task, row in result["retention"]["preset:balanced"].items():
        assert row["low"] <= row["retention"] <= row["high"] and 0 < row["kv_saved"] < 1
        assert len(result["tasks"][task]["cells"]["static"]["per_example"]) == 2
    assert "## Retention (held_out)" in (tmp_path / "kv_tasks.md").read_text()


def test_candidate_fractions_run_fixed_dials_like_presets():
    import torch

    from flashx_batch.quality.kv_tasks import cells_for
    from flashx_batch.quality.kv_tasks_report import fixed_dials
    from flashx_batch.runtime.kv_merge import MergeSettings, compressed_length
    from flashx_batch.runtime.options import KV_PRESETS

    assert fixed_dials("preset:aggressive") == KV_PRESETS["aggressive"]
    assert fixed_dials("fraction:0.75") == (0.75, KV_PRESETS["balanced"][1])
    assert fixed_dials("fraction:lots") is None and fixed_dials("fraction:2") is None
    assert fixed_dials("segment_sparse") is None
    assert cells_for(["static", "fraction:0.7", "segment_sparse"], [0.3, 0.5]) == [
        ("static", 0.0), ("fraction:0.7", 0.0), ("segment_sparse", 0.3), ("segment_sparse", 0.5)]
    length = 400
    plan, _ = policy_plan("fraction:0.7", length, 0.0, torch.rand(length), 0, 4, 32, torch.zeros(length), 6.0)
    assert plan.num_slots == compressed_length(length, MergeSettings(0.7, 4, 32, evict_share=1.0))


def test_the_static_cache_does_not_depend_on_the_presets():
    """Choosing presets changes what segment_sparse keeps, never a static-cache row's tokens."""
    from flashx_batch import Engine, SamplingParams
    from flashx_batch.runtime.options import KV_PRESETS, bundled_model_dir

    prompts = [list(range(40, 140)), list(range(300, 360))]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = []
    for preset in KV_PRESETS:
        engine = Engine.from_pretrained(bundled_model_dir(), backend="cpu", dtype="float32", max_batch_size=2,
                                        max_input_len=128, max_output_len=12, kv_preset=preset)
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert all(out == outs[0] for out in outs)
