"""A new user's first hour: their own file under the default preset, the paths and keys they type, the
output location they pick, a scoring job's report, and a task added through the task protocol. Each
test here failed on the code before these fixes (the default preset's `source` column, Hydra's grammar
on `=` in values, no "did you mean", the output check after Ray's start, scoring jobs reported as
generation)."""

from __future__ import annotations

import json
import logging

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_support import cli, write_parquet

from flashx_batch import run_job
from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner.job import plan_job, run
from flashx_batch.runtime.options import bundled_model_dir

FAST = ("executor.kind=local", "sampling.max_new_tokens=4", "executor.progress_interval_s=1000")


def _own_file(path, n=12, blank=()):
    """A user's JSONL: only `id` and `prompt` (rows in `blank` have an empty prompt)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "prompt": "" if i in blank else f"Summarise clause {i} of the "
                                        "licence: the licensee shall not sublicense."}) + "\n" for i in range(n)))
    return path


def test_the_default_preset_runs_on_a_file_with_only_an_id_and_a_prompt(tmp_path):
    data, out = _own_file(tmp_path / "mine.jsonl", blank={3}), tmp_path / "out"
    assert run(compose_job(["conf=legal_docs", f"data.path={data}", f"output.dir={out}", *FAST])) == 0
    table = pq.read_table(out / "generations")
    assert sorted(table.column("id").to_pylist()) == [i for i in range(12) if i != 3]
    assert "source" not in table.column_names  # the preset's column is copied only where the input has it
    report = (out / "report.md").read_text()
    # the error table gives the code, an example message and the fix
    assert "| empty_prompt | 1 | prompt is empty or whitespace only | give the row a non-empty prompt |" in report


def test_chat_and_multiple_choice_files_plan_under_a_preset_that_names_columns_they_lack(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Who is the licensor?"}]}) + "\n")
    assert run(compose_job(["conf=legal_docs", f"data.path={chat}", "data.messages_column=messages",
                            f"output.dir={tmp_path / 'o1'}", "dry_run=true"])) == 0
    mc = tmp_path / "mc.jsonl"
    mc.write_text(json.dumps({"id": 1, "context": "The term is", "choices": ["one year", "two years"],
                              "answer": 0}) + "\n")
    assert run(compose_job(["conf=legal_docs", f"data.path={mc}", "task=multiple_choice",
                            f"output.dir={tmp_path / 'o2'}", "dry_run=true"])) == 0


def test_a_missing_column_names_the_setting_that_asked_for_it(tmp_path, caplog):
    data = _own_file(tmp_path / "mine.jsonl")
    base = ["conf=legal_docs", f"data.path={data}", f"output.dir={tmp_path / 'out'}", "dry_run=true"]
    assert run(compose_job([*base, "data.passthrough_columns=[source]"])) == 2  # asked for: an error
    assert "'source' (data.passthrough_columns asks for it" in caplog.text
    assert "data.passthrough_if_present" in caplog.text  # and how to copy it only where it exists
    caplog.clear()
    assert run(compose_job([*base, "data.prompt_column=text"])) == 2
    assert "'text' (named by data.prompt_column" in caplog.text


def test_run_job_names_the_object_it_was_given_not_its_staged_file(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    frame = pd.DataFrame({"id": [1, 2], "text": ["a", "b"]})
    assert run_job(["conf=legal_docs", f"output.dir={tmp_path / 'out'}", *FAST], data=frame,
                   staging_dir=str(tmp_path / "stage")) == 2
    assert "run_job(data=<pandas.DataFrame>): missing column(s) 'prompt'" in caplog.text
    assert "input-" not in caplog.text
    assert not (tmp_path / "stage").exists()  # refused before anything was staged


def test_openai_batch_files_refuse_a_passthrough_column_they_cannot_have(tmp_path):
    batch = tmp_path / "requests.jsonl"
    batch.write_text(json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "m", "prompt": "Hi", "max_tokens": 4}}) + "\n")
    base = ["conf=legal_docs", f"data.path={batch}", "data.format=openai_batch", f"output.dir={tmp_path / 'o'}",
            "dry_run=true"]
    job = compose_job(base)
    assert run(job) == 0  # the preset's passthrough_if_present finds nothing: no warning, no refusal
    assert job.data.id_column == "id"  # the user's config is not rewritten (the run derives its own)
    with pytest.raises(ConfigError, match="request lines have no such column"):
        plan_job(compose_job([*base, "data.passthrough_columns=[source]"]))


def test_an_output_dir_that_is_a_file_is_refused_in_preflight(tmp_path):
    data = _own_file(tmp_path / "mine.jsonl")
    (tmp_path / "taken").write_text("x")
    for out, message in ((tmp_path / "taken", "is a file"), (tmp_path / "taken" / "sub", "has a file in its path")):
        with pytest.raises(ConfigError, match=message):  # before Ray starts: plan_job starts nothing
            plan_job(compose_job(["conf=legal_docs", f"data.path={data}", f"output.dir={out}"]))


def test_values_with_equals_signs_are_quoted_as_typed():
    from flashx_batch.config import quote_overrides

    assert quote_overrides(["data.path=s3://lake/in/day=1/", "output.dir=/d/out/dt=2026-11-29"]) == \
        ["data.path='s3://lake/in/day=1/'", "output.dir='/d/out/dt=2026-11-29'"]
    kept = ["runtime.max_batch_size=2,4", "data.path=/x/*.parquet", "executor.faults=['a:b=c']", "conf=smoke",
            "data.path='q=1'", "--multirun"]
    assert quote_overrides(kept) == kept


def test_a_hive_partition_path_and_a_misspelled_key_on_the_command_line(tmp_path):
    part = tmp_path / "in" / "day=1"
    _own_file(part / "rows.jsonl", n=4)
    done = cli(["conf=legal_docs", f"data.path={part}/", f"output.dir={tmp_path}/out/dt=2026-11-29", "dry_run=true"],
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 rows" in done.stderr and "nothing was written" in done.stdout
    typo = cli(["conf=legal_docs", "sampling.max_new_token=16", "dry_run=true"], cwd=tmp_path)
    assert typo.returncode == 2
    assert "did you mean sampling.max_new_tokens?" in typo.stderr


def test_a_multiple_choice_job_reports_its_accuracy_and_no_token_rates(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    items = pq.read_table(bundled_model_dir().parent.parent / "data" / "legal_eval.parquet").to_pylist()[:8]
    data, out = write_parquet(tmp_path / "mc.parquet", items), tmp_path / "mc"
    assert run(compose_job(["conf=legal_docs", f"data.path={data}", f"output.dir={out}", "task=multiple_choice",
                            "runtime.long_input=truncate", *FAST])) == 0
    totals = json.loads((out / "job.json").read_text())["totals"]
    assert totals["eval"]["metric"] == "choice_accuracy" and totals["eval"]["scored"] == 8
    report = (out / "report.md").read_text()
    assert "Task: multiple_choice." in report and "rows/s" in report and "output tok/s" not in report
    assert not (out / "report_tok_per_s.png").exists() and (out / "report_rows_per_s.png").is_file()
    assert "8 scored" in caplog.text and "generated" not in caplog.text.split("done:")[-1].split("\n")[0]


def test_a_task_added_through_the_protocol_runs_end_to_end(tmp_path):
    """One module's worth of code (a `Task` subclass, registered) is a new `task=` with its own result rows,
    planned, run, committed, verified and reported by the job layer like every other task."""
    from flashx_batch.data.plan import plan_prompts
    from flashx_batch.tasks import ShardResult, ShardRows, Task, register
    from flashx_batch.tasks import base as task_base

    class CountWords(Task):
        name = "count_words"

        def text_column(self, data):
            return data.prompt_column

        def column_roles(self, data):
            return {data.prompt_column: "data.prompt_column"}

        def result_columns(self):
            return ("id", "words", "shard_id")

        def plan(self, job, loaded, tokenizer):
            return plan_prompts(job, loaded, tokenizer)

        def read(self, source, spec):
            rows = source.shard_rows(spec)
            return ShardRows([fr.columns["id"][k] for _, _, fr, k in rows],
                             [fr.columns["prompt"][k] for _, _, fr, k in rows])

        def compute(self, source, rows, spec):
            words = [len(t.split()) for t in rows.inputs]
            table = pa.table({"id": pa.array(rows.ids, pa.int64()), "words": pa.array(words, pa.int32()),
                              "shard_id": pa.array([spec.shard_id] * len(rows.ids))})
            return ShardResult(table, sum(words), 0)

    register(CountWords)
    try:
        data, out = _own_file(tmp_path / "mine.jsonl", n=6), tmp_path / "out"
        assert run(compose_job(["conf=legal_docs", f"data.path={data}", f"output.dir={out}", "task=count_words",
                                *FAST])) == 0
        table = pq.read_table(out / "generations")
        assert sorted(zip(table.column("id").to_pylist(), table.column("words").to_pylist(), strict=True)) == \
            [(i, 11) for i in range(6)]
    finally:
        task_base._REGISTRY.pop("count_words")
