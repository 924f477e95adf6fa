"""Evaluation metrics: normalisation, each metric's rule, unscorable rows counted (not dropped), and a
seeded bootstrap interval that brackets the mean and narrows with more rows; the bundled evaluation set
is well formed."""

import pyarrow.parquet as pq
import pytest

from flashx_batch.evaluation.metrics import check_metric, normalise, score_row, summarise
from flashx_batch.runtime.options import bundled_model_dir


def test_normalisation_folds_case_space_and_edge_punctuation():
    assert normalise("  The  GPL-2+ licence.\n") == "the gpl-2+ licence"
    assert normalise("\uff21pache") == "apache"  # NFKC: full-width A
    assert normalise("(MIT)") == "mit"


@pytest.mark.parametrize("metric, prediction, reference, pattern, expected", [
    ("exact_match", " BSD-3-clause. ", "bsd-3-clause", None, 1.0),
    ("exact_match", "BSD-3-clause or MIT", "bsd-3-clause", None, 0.0),
    ("contains", "It is the Expat licence, also called MIT.", "mit", None, 1.0),
    ("contains", "GPL", "LGPL", None, 0.0),
    ("regex", "Answer: Apache-2.0\nbecause", "apache-2.0", r"Answer:\s*(\S+)", 1.0),
    ("regex", "no answer here", "apache-2.0", r"Answer:\s*(\S+)", 0.0),
    ("choice_accuracy", 2, 2, None, 1.0),
    ("choice_accuracy", 1, 2, None, 0.0),
    ("exact_match", "x", None, None, None),  # no reference: unscored
    ("contains", None, "x", None, None),  # an error row: unscored
])
def test_each_metric(metric, prediction, reference, pattern, expected):
    assert score_row(metric, prediction, reference, check_metric(metric, pattern)) == expected


def test_bad_metric_settings_are_refused():
    with pytest.raises(ValueError, match="not a metric"):
        check_metric("bleu", None)
    with pytest.raises(ValueError, match="needs eval.regex"):
        check_metric("regex", None)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        check_metric("regex", "(")
    with pytest.raises(ValueError, match="applies to metric=regex only"):
        check_metric("exact_match", "x")


def test_summary_counts_unscored_rows_and_brackets_the_mean():
    small = summarise("exact_match", [1.0, 0.0, 1.0, None] * 10)
    assert (small.scored, small.unscored, small.mean) == (30, 10, pytest.approx(2 / 3))
    assert small.ci_low < small.mean < small.ci_high
    assert summarise("exact_match", [1.0, 0.0, 1.0, None] * 10) == small  # seeded: reproducible
    large = summarise("exact_match", [1.0, 0.0, 1.0] * 1000)
    assert large.ci_high - large.ci_low < (small.ci_high - small.ci_low) / 3  # 100x rows: ~1/10 the width
    assert summarise("exact_match", [None, None]).mean is None


def test_the_bundled_eval_set_is_well_formed():
    rows = pq.read_table(bundled_model_dir().parent.parent / "data" / "legal_eval.parquet").to_pylist()
    assert len(rows) >= 200
    for r in rows:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4
        assert r["choices"][r["answer"]] == r["continuation"] and r["context"].strip()
    answers = [r["answer"] for r in rows]
    assert all(answers.count(i) > len(rows) / 8 for i in range(4))  # the true choice is not always first
    assert len({r["id"] for r in rows}) == len(rows)
