"""Jobs that evaluate (`eval.*`): a per-row `score` column against each row's reference, unscorable rows
(null reference, error rows) counted as such, and the job's mean with its bootstrap interval in job.json,
_SUCCESS and report.md (with its plot); multiple choice scored by choice accuracy; bad settings refused."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from batch_support import overrides, sample_rows, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner import run
from flashx_batch.runtime.options import bundled_model_dir


def _rows(out):
    return {r["id"]: r for r in pq.read_table(out / "generations").to_pylist()}


def test_generate_job_scores_each_row_and_reports_the_interval(tmp_path):
    model = bundled_model_dir()
    rows = sample_rows(16, seed=3)
    rows[5]["prompt"] = None  # an error row: unscored
    first = tmp_path / "first"
    assert run(compose_job(overrides(model, write_parquet(tmp_path / "in.parquet", rows), first))) == 0
    generated = _rows(first)
    # references: the model's own text for even ids (exact match), another text for odd ids, none for id 2
    for r in rows:
        text = generated.get(r["id"], {}).get("generated_text")
        r["ref"] = None if r["id"] == 2 else (text if r["id"] % 2 == 0 else "no such answer")
    data = write_parquet(tmp_path / "with_refs.parquet", rows)
    out = tmp_path / "eval"
    assert run(compose_job(overrides(model, data, out, "eval.metric=exact_match", "eval.reference_column=ref"))) == 0
    got = _rows(out)
    for i, r in got.items():
        assert r["score"] == (None if i == 2 else float(i % 2 == 0))
    summary = json.loads((out / "job.json").read_text())["totals"]["eval"]
    scored = [r["score"] for r in got.values() if r["score"] is not None]
    assert summary["metric"] == "exact_match" and summary["scored"] == len(scored) == 14
    assert summary["unscored"] == 2  # the null reference and the error row
    assert summary["mean"] == pytest.approx(sum(scored) / len(scored))
    assert summary["ci_low"] < summary["mean"] < summary["ci_high"]
    assert json.loads((out / "_SUCCESS").read_text())["eval"] == summary
    report = (out / "report.md").read_text()
    assert "## Evaluation" in report and "exact_match = " in report and (out / "report_metric.png").is_file()


def test_multiple_choice_job_scores_choice_accuracy(tmp_path):
    model = bundled_model_dir()
    items = pq.read_table(model.parent.parent / "data" / "legal_eval.parquet").to_pylist()[:24]
    data = write_parquet(tmp_path / "mc.parquet", items)
    out = tmp_path / "mc"
    # some items' context and choices pass the preset's max_input_len: scored on their last tokens, flagged
    assert run(compose_job(overrides(model, data, out, "task=multiple_choice", "eval.metric=choice_accuracy",
                                     "runtime.long_input=truncate"))) == 0
    got = _rows(out)
    assert len(got) == 24 and 0 < sum(r["truncated"] for r in got.values()) < 24
    assert all(r["score"] == float(r["correct"]) and r["correct"] == (r["pred"] == items[i]["answer"])
               for i, r in got.items())
    summary = json.loads((out / "job.json").read_text())["totals"]["eval"]
    assert summary["scored"] == 24 and summary["mean"] == pytest.approx(sum(r["score"] for r in got.values()) / 24)


@pytest.mark.parametrize("extra, message", [
    (["eval.metric=exact_match"], "needs eval.reference_column"),
    (["eval.metric=bleu", "eval.reference_column=ref"], "not a metric"),
    (["eval.metric=regex", "eval.reference_column=ref"], "needs eval.regex"),
    (["eval.metric=choice_accuracy"], "task=multiple_choice"),
    (["task=multiple_choice", "eval.metric=exact_match", "eval.reference_column=ref"], "generates none"),
    (["eval.reference_column=ref"], "eval.metric is not"),
])
def test_bad_eval_settings_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(overrides(bundled_model_dir(), "in.parquet", None, *extra))
