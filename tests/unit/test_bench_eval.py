"""The harness's evaluation workload: it builds >= 200 items x 4 choices from the bundled eval set, the
comparison counts equal predictions and accuracies, and the results files carry the eval fields. No
model runs and no timing assertions: the two sides' runs are stood in for."""

from __future__ import annotations

from flashx_batch.bench import __main__ as harness
from flashx_batch.bench import eval_mc, report


def test_the_full_workload_is_every_bundled_item_with_four_choices():
    items = eval_mc.load_items(eval_mc.FULL_ITEMS)
    reqs = eval_mc.requests(items)
    assert len(items) >= 200 and len(reqs) == 4 * len(items) >= 800
    assert all(len(r["choices"]) == 4 for r in items)
    assert reqs[0] == (items[0]["context"], " " + items[0]["choices"][0])
    overrides = eval_mc.job_overrides(eval_mc.EVAL_SET, len(items), 1)
    assert "task=multiple_choice" in overrides and f"data.limit={len(items)}" in overrides
    quick = harness.eval_settings(harness.settings_from(harness.parse_args(["--out", "x", "--quick"])))
    full = harness.eval_settings(harness.settings_from(harness.parse_args(["--out", "x"])))
    assert quick.items < full.items == eval_mc.FULL_ITEMS and full.repeats <= 3


def _fake_runs(items, flip: int | None = None):
    ref = [[-1.0 * (j != r["answer"]) - 2.0 for j in range(4)] for r in items]
    ours = {r["id"]: {"choice_logprobs": lps, "pred": r["answer"], "correct": True,
                      "pred_norm": eval_mc.first_argmax([lp / len(c) for lp, c in zip(lps, r["choices"])])}
            for r, lps in zip(items, ref)}
    if flip is not None:
        ref[flip] = [-2.0, -2.0, -2.0, -2.0]  # a tie: lm-eval picks the first
    return ours, ref


def test_results_fields_and_markdown():
    items = eval_mc.load_items(eval_mc.QUICK_ITEMS)
    flip = next(i for i, r in enumerate(items) if r["answer"] != 0)
    ours, ref = _fake_runs(items, flip)
    checks = eval_mc.compare(items, ours, ref)
    assert checks["predictions_equal"] == len(items) - 1
    assert items[flip]["id"] in [d["id"] for d in checks["differing"]]
    assert checks["differing"][0]["margin_lm_eval"] == 0.0
    assert checks["accuracy"]["ours"] == 1.0 and checks["accuracy"]["lm_eval"] == (len(items) - 1) / len(items)
    runs = [{"scoring_s": 1.0, "e2e_s": 1.5, "load_s": 0.5, "by_id": ours}] * 2
    refs = [{"scoring_s": 3.5, "e2e_s": 4.0, "load_s": 0.5, "logprobs": ref}] * 2
    e = eval_mc.summarise(eval_mc.EvalSettings(len(items), 2, 1), runs, refs, checks, True)
    for key in ("items", "requests", "ours_scoring_s", "lm_eval_scoring_s", "ours_e2e_s", "lm_eval_e2e_s",
                "ratio_scoring", "ratio_e2e", "predictions_equal", "predictions_norm_equal", "accuracy",
                "accuracy_norm", "max_abs_logprob_diff", "threads", "repeats"):
        assert key in e, key
    assert e["ratio_scoring"]["median"] == 3.5 and e["ratio_scoring"]["met"]
    doc = report.results_document({}, {}, {"threads": 1}, {"quick": True, "repeats": 2, "workloads": {}})
    doc["eval"] = e
    md = report.markdown(doc)
    assert "## Evaluation" in md and f"predictions equal: {len(items) - 1}/{len(items)}" in md
