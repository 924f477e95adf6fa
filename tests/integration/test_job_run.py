"""A whole job, in process and through the real CLI: layout, invariant, exit codes, resume rules."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from batch_support import REPO, cli, output_ids, overrides, sample_rows, tiny_model_dir, tree_snapshot, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.runner import run
from flashx_batch.tasks.tables import ERROR_COLUMNS, GENERATION_COLUMNS, STATS_COLUMNS


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    rows = sample_rows(20)
    rows[2]["prompt"] = None
    rows[5]["prompt"] = ""
    rows[7]["prompt"] = " ".join(["licence"] * 700)  # > max_input_len=512
    return {"model": tiny_model_dir(), "data": write_parquet(root / "in.parquet", rows), "n": len(rows)}


@pytest.fixture(scope="module")
def finished(inputs, tmp_path_factory):
    """One completed job (local executor), shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("runs") / "done"
    job = compose_job(overrides(inputs["model"], inputs["data"], out, "data.passthrough_columns=[source]"))
    assert run(job) == 0
    return out


def test_layout_columns_and_invariant(finished, inputs):
    out = finished
    for name in ("job.json", "_SUCCESS", "report.md", "report_tok_per_s.png", "report_padding.png",
                 "report_shard_wall.png"):
        assert (out / name).is_file(), name
    gen = pq.read_table(out / "generations")
    assert gen.column_names == [*GENERATION_COLUMNS, "source"]
    assert set(gen.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert gen.column("source").to_pylist() == [f"doc-{i}" for i in gen.column("id").to_pylist()]
    assert pq.read_table(out / "errors").column_names == list(ERROR_COLUMNS)
    stats = pq.read_table(out / "stats")
    assert stats.column_names[: len(STATS_COLUMNS)] == list(STATS_COLUMNS)
    assert set(stats.column("attempt").to_pylist()) == {1}
    generated, errors = output_ids(out)
    assert max((generated + errors).values()) == 1
    assert set(generated) | set(errors) == set(range(inputs["n"])) and not set(generated) & set(errors)
    codes = dict(zip(*pq.read_table(out / "errors").select(["id", "error_code"]).to_pydict().values(), strict=True))
    assert codes == {2: "null_prompt", 5: "empty_prompt", 7: "prompt_too_long"}
    manifests = {p.stem for p in (out / "_manifest").glob("*.json")}
    record = json.loads((out / "job.json").read_text())
    assert manifests == set(record["plan"]["shard_ids"]) and record["status"] == "succeeded"
    success = json.loads((out / "_SUCCESS").read_text())
    assert success["generated_rows"] == 17 and success["error_rows"] == 3
    assert success["output_tokens"] == sum(gen.column("num_generated_tokens").to_pylist())


def test_rerun_of_a_finished_job_changes_no_results(finished, inputs):
    before = {k: v for k, v in tree_snapshot(finished).items() if k.startswith(("generations", "errors", "_manifest"))}
    assert run(compose_job(overrides(inputs["model"], inputs["data"], finished,
                                     "data.passthrough_columns=[source]", "runtime.max_batch_size=2"))) == 0
    after = {k: v for k, v in tree_snapshot(finished).items() if k.startswith(("generations", "errors", "_manifest"))}
    assert before == after  # max_batch_size is a throughput knob: not in the fingerprint, nothing redone


def test_changed_sampling_on_resume_is_refused(finished, inputs, tmp_path):
    before = tree_snapshot(finished)
    proc = cli(overrides(inputs["model"], inputs["data"], finished, "data.passthrough_columns=[source]",
                         "sampling.temperature=0.5"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "sampling.temperature" in proc.stderr and "0.0 -> 0.5" in proc.stderr
    assert tree_snapshot(finished) == before


def test_dry_run_writes_nothing_and_reports_both_paddings(inputs, tmp_path):
    out = tmp_path / "out"
    proc = cli(overrides(inputs["model"], inputs["data"], out, "dry_run=true"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "with bucketing" in proc.stdout and "without bucketing" in proc.stdout
    assert "prompt_too_long=1" in proc.stdout
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] or not any(tmp_path.iterdir())


@pytest.mark.parametrize("problem", ["missing", "corrupt", "duplicate", "column"])
def test_preflight_failure_exits_2_output_untouched(inputs, tmp_path, problem):
    bad = tmp_path / "bad.parquet"
    if problem == "corrupt":
        bad.write_bytes(b"PAR1garbagePAR1")
    elif problem == "duplicate":
        write_parquet(bad, [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    elif problem == "column":
        write_parquet(bad, [{"id": 1, "text": "a"}])
    out = tmp_path / "out"
    assert run(compose_job(overrides(inputs["model"], bad, out))) == 2
    assert not out.exists()


def test_cli_preflight_and_config_errors_exit_2(inputs, tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("user data")
    proc = cli(overrides(inputs["model"], tmp_path / "nope.parquet", existing), cwd=tmp_path)
    assert proc.returncode == 2 and "nope.parquet" in proc.stderr
    proc = cli(overrides(inputs["model"], inputs["data"], existing), cwd=tmp_path)
    assert proc.returncode == 2 and "not empty" in proc.stderr  # not a job directory: refuse to write
    proc = cli(overrides(inputs["model"], inputs["data"], existing, "runtime.max_bach_size=3"), cwd=tmp_path)
    assert proc.returncode == 2 and "max_bach_size" in proc.stderr
    assert tree_snapshot(existing) == {"keep.txt": b"user data"}


def test_multirun_sweep_and_gather(inputs, tmp_path):
    sys.path.insert(0, str(REPO / "jobs" / "operations"))
    from eval_sweep import gather, write_leaderboard

    out = tmp_path / "sweep"
    proc = cli(["-m", *overrides(inputs["model"], inputs["data"], out, "data.limit=6"),
                "runtime.max_batch_size=2,4"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert runs == ["runtime.max_batch_size=2", "runtime.max_batch_size=4"]
    assert all((out / r / "_SUCCESS").is_file() for r in runs)
    rows = gather(out)  # no eval.metric: listed with an empty metric, not dropped
    assert sorted(r["max_batch_size"] for r in rows) == [2, 4] and all(r["status"] == "succeeded" for r in rows)
    assert all(r["mean"] == "" for r in rows)
    assert "runtime.max_batch_size=4" in write_leaderboard(out, rows) and (out / "leaderboard.csv").is_file()


def test_eval_sweep_preset_gives_a_leaderboard_with_intervals(tmp_path):
    """`python jobs/operations/eval_sweep.py --out DIR` (the shipped grid: two dtypes x two context lengths) on a
    slice of the bundled evaluation set: every point scored, best first, with its interval."""
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "operations" / "eval_sweep.py"), "--out", str(out),
                           "--split-by", "seen_in_training", "data.limit=40", "executor.progress_interval_s=1000"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out / "leaderboard.csv")))
    assert len(rows) == 4 and {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    means = [float(r["mean"]) for r in rows]
    assert means == sorted(means, reverse=True)
    for r in rows:
        assert r["metric"] == "choice_accuracy" and r["status"] == "succeeded"
        assert float(r["ci_low"]) <= float(r["mean"]) <= float(r["ci_high"])
        assert int(r["scored"]) + int(r["unscored"]) == 40
        assert r["seen_in_training=True"]
    assert (out / "leaderboard.png").is_file() and "Evaluation leaderboard" in (out / "leaderboard.md").read_text()


def test_nightly_etl_dated_dir_and_exit_codes(inputs, tmp_path):
    import shutil
    import sys

    sys.path.insert(0, str(REPO / "jobs" / "operations"))
    from nightly_etl import main

    day = tmp_path / "in" / "2026-11-29"
    day.mkdir(parents=True)
    shutil.copy(inputs["data"], day / "docs.parquet")
    args = ["--input-root", str(tmp_path / "in"), "--output-root", str(tmp_path / "out"), "--date", "2026-11-29",
            "--preset", "smoke", f"model.path={inputs['model']}", "data.limit=4", "data.passthrough_columns=[]",
            "data.passthrough_if_present=[]"]
    assert main(args) == 0
    assert (tmp_path / "out" / "2026-11-29" / "_SUCCESS").is_file()
    assert main([*args[:5], "2026-11-30", *args[6:]]) == 2  # no input folder for that day: bad job
    assert main([*args[:5], "yesterday", *args[6:]]) == 2


def test_smoke_preset_runs_on_the_bundled_model_and_sample(tmp_path):
    # The preset exactly as shipped (bundled model + bundled sample), only the output redirected.
    out = tmp_path / "smoke"
    assert run(compose_job(["conf=smoke", f"output.dir={out}"])) == 0
    generated, errors = output_ids(out)
    assert sum(generated.values()) + sum(errors.values()) == 12 and max((generated + errors).values()) == 1
