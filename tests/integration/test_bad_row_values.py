"""Bad inputs on the newer data paths (OpenAI Batch files, per-row sampling), each a user's data that
once ended a job or turned good rows away: every value a row gives is read by one parser
(`data.row_values`) that makes anything unrepresentable that row's error, and a row-value fuzz run
proves no value ends a job."""

from __future__ import annotations

import json
import random
from collections import Counter

import pyarrow.parquet as pq
from batch_support import overrides, tiny_model_dir
from row_value_cases import HUGE
from row_value_cases import line as _line
from row_value_cases import values as _values

from flashx_batch.config import SAMPLING_COLUMN_KEYS, DataSection, SamplingSection, compose_job
from flashx_batch.data import openai_batch
from flashx_batch.data.row_sampling import row_params
from flashx_batch.data.row_values import as_float, as_int, describe
from flashx_batch.data.validate import RowProblem, ScoreRow, score_row
from flashx_batch.runner import run
from flashx_batch.runtime.grammar import compile_check
from flashx_batch.runtime.options import bundled_model_dir
from flashx_batch.runtime.params import SamplingParams
from flashx_batch.runtime.tokenizer import Tokenizer


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _run(path, out, *extra):
    return run(compose_job(overrides(tiny_model_dir(), path, out, "data.format=openai_batch", "executor.kind=local",
                                     "runtime.max_output_len=16", "sampling.max_new_tokens=3", *extra)))


def _errors(out):
    files = sorted((out / "errors").glob("*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return {r["id"]: (r["error_code"], r["error_message"]) for r in rows}


def _generated(out):
    files = sorted((out / "generations").glob("*.parquet"))
    return Counter(r["id"] for f in files for r in pq.read_table(f).to_pylist())


def test_huge_integers_where_numbers_belong_are_error_rows(tmp_path):
    """A 400-digit integer as temperature, top_p, max_tokens, top_k or logprobs once ended the job (exit 1,
    OverflowError): now each is that line's error row, naming the field, and the good line runs."""
    lines = [_line("t", temperature=HUGE), _line("p", top_p=HUGE), _line("m", max_tokens=HUGE),
             _line("k", top_k=HUGE), _line("l", logprobs=HUGE), _line("s", seed=[1, 2]), _line("ok")]
    out = tmp_path / "out"
    assert _run(_write(tmp_path / "big.jsonl", lines), out) == 0
    errors = _errors(out)
    assert sorted(errors) == ["k", "l", "m", "p", "s", "t"] and _generated(out) == Counter(["ok"])
    for cid, field in (("t", "temperature"), ("p", "top_p"), ("m", "max_new_tokens"), ("k", "top_k")):
        code, message = errors[cid]
        assert code == "bad_sampling_param" and field in message and "401 digits" in message, message
    assert errors["l"][0] == "bad_request" and "logprobs" in errors["l"][1] and "401 digits" in errors["l"][1]


def test_a_bad_first_line_does_not_decide_the_endpoint(tmp_path):
    """A first line with a mistyped url (or not an object) once made the batch a chat batch and turned
    every good completions line away: the endpoint is the first line's that names one."""
    for first in (_line("typo", url="/v1/completion"), "[1, 2, 3]"):
        lines = [first, *(_line(f"g{i}") for i in range(5))]
        out = tmp_path / f"out-{len(str(first))}"
        assert _run(_write(tmp_path / f"f{len(str(first))}.jsonl", lines), out) == 0
        assert _generated(out) == Counter(f"g{i}" for i in range(5))
        assert len(_errors(out)) == 1


def test_lines_without_ids_in_two_files_of_one_name_do_not_collide(tmp_path):
    """x/requests.jsonl and y/requests.jsonl, each with a line missing custom_id: two bad_request rows,
    not a duplicated-id refusal."""
    root = tmp_path / "in"
    for sub in ("x", "y"):
        (root / sub).mkdir(parents=True)
        _write(root / sub / "requests.jsonl", [{"method": "POST", "url": openai_batch.COMPLETIONS,
                                                  "body": {"prompt": "hi"}}, _line(f"ok-{sub}")])
    out = tmp_path / "out"
    assert _run(root, out) == 0
    errors = _errors(out)
    assert len(errors) == 2 and all(code == "bad_request" for code, _ in errors.values())
    assert {i.split(" line")[0].rsplit("/", 2)[-2] for i in errors} == {"x", "y"}
    assert _generated(out) == Counter(["ok-x", "ok-y"])


def test_logprobs_fields_that_would_be_served_without_logprobs_are_refused():
    raw = "\n".join(json.dumps(x) for x in [
        _line("a", url=openai_batch.CHAT, top_logprobs=2),  # without logprobs: true
        _line("b", logprobs=True),  # completions: a count, not a flag
        _line("c", url=openai_batch.CHAT, logprobs=True, top_logprobs=-1),
        _line("d", url=openai_batch.CHAT, logprobs=True, top_logprobs=2),
        _line("e", logprobs=2),
    ]).encode()
    cols = openai_batch.parse("f.jsonl", raw)
    problems = dict(zip(cols["custom_id"], cols["request_error"]))
    assert "without logprobs: true" in problems["a"] and "number of top logprobs" in problems["b"]
    assert "integer >= 0" in problems["c"] and problems["d"] is None and problems["e"] is None
    assert dict(zip(cols["custom_id"], cols["logprobs"]))["d"] == 2


# ---- the row-value fuzz: every value a row can give (`row_value_cases.values`), through every per-row reader

def test_no_row_value_ends_a_job():
    """Every value above, in every sampling column and every OpenAI body field: the per-row readers give
    parameters or a row error, never an exception; `describe` prints each; the parameters that pass
    are valid `SamplingParams` within int64 and float range (what Arrow and torch take)."""
    rng = random.Random(0)
    values = _values(rng)
    keys = tuple(SAMPLING_COLUMN_KEYS)
    sampling = SamplingSection(from_columns={k: k for k in keys})
    data = DataSection(answer_column="answer", prompt_column="text")
    examples, kinds = 0, Counter()
    # a row's constraint is compiled by the grammar library while planning: no value may make it raise
    compiles = compile_check(Tokenizer(bundled_model_dir()))
    for value in values:
        assert isinstance(describe(value), str)
        assert as_int(value) is None or -(2**63) <= as_int(value) < 2**63
        assert as_float(value) is None or abs(as_float(value)) < float("inf")
        for key in keys:
            columns = {k: [value if k == key else None] for k in keys}
            got = row_params(sampling, columns, 0, 7, 64, compiles)
            examples += 1
            assert isinstance(got, RowProblem | SamplingParams)
            if isinstance(got, RowProblem):
                kinds[got.code] += 1
            else:
                assert abs(got.temperature) < float("inf") and got.top_k < 2**63 and got.max_new_tokens <= 64
        for field in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs", "top_logprobs",
                      "prompt", "messages", "tools", "model", "stream", "response_format"):
            for url in (openai_batch.CHAT, openai_batch.COMPLETIONS):
                try:  # a value JSON cannot write (past Python's 4,300 digits) never reaches a line
                    text = json.dumps(_line("x", url=url, **{field: value}))
                except ValueError:
                    continue
                cols = openai_batch.parse("f.jsonl", text.encode("utf-8", errors="surrogatepass"))
                examples += 1
                assert len(cols["custom_id"]) == 1
                problem = cols["request_error"][0]
                kinds["bad_request"] += problem is not None
                if problem is None:  # what reaches the sampling columns is read by row_params above
                    assert cols["custom_id"] == ["x"]
        for task, column in (("multiple_choice", "answer"), ("multiple_choice", "choices"),
                             ("multiple_choice", "context"), ("loglikelihood", "continuation"), ("perplexity", "text")):
            columns = {"context": ["the licence"], "continuation": [" is void"], "choices": [["a", "b"]],
                       "answer": [0], "text": ["the licence"], column: [value]}
            got = score_row(task, data, columns, 0)
            examples += 1
            assert isinstance(got, RowProblem | ScoreRow)
            if isinstance(got, RowProblem):
                kinds["score row"] += 1
    assert examples > 8_500 and set(kinds) == {"bad_sampling_param", "bad_constraint", "bad_request", "score row"}


def test_a_resume_where_auto_resolves_to_another_dtype_is_refused(tmp_path, monkeypatch, caplog):
    """A job started where `model.dtype=auto` meant float32, resumed where it means bfloat16 (a GPU host,
    simulated by the CPU backend's default): refused with exit 2 naming the resolved precision, never a
    second precision mixed into the output. A worker whose engine resolved otherwise refuses too."""
    import types

    import pytest
    import torch

    from flashx_batch.backends.cpu import CpuBackend
    from flashx_batch.errors import ConfigError
    from flashx_batch.runner.worker import _check_resolved

    data = _write(tmp_path / "in.jsonl", [_line(f"r{i}") for i in range(4)])
    out = tmp_path / "out"
    assert _run(data, out, "runtime.backend=auto", "model.dtype=auto") == 0
    assert json.loads((out / "job.json").read_text())["fingerprint"]["runtime.resolved"] == "cpu/float32"
    monkeypatch.setattr(CpuBackend, "default_dtype", torch.bfloat16)
    assert _run(data, out, "runtime.backend=auto", "model.dtype=auto") == 2
    assert "runtime.resolved: 'cpu/float32' -> 'cpu/bfloat16'" in caplog.text
    engine = types.SimpleNamespace(backend=types.SimpleNamespace(name="cpu"), dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="runs as cpu/bfloat16.*computed as cpu/float32"):
        _check_resolved(engine, "cpu/float32", "worker-1")
    _check_resolved(engine, "cpu/bfloat16", "worker-1")
    _check_resolved(engine, None, "worker-1")  # a job that could not resolve it: nothing to hold it to


def test_run_job_meets_a_dataframe_arrow_cannot_hold_as_a_file_of_the_same_rows(tmp_path, caplog):
    """A DataFrame column of mixed Python types once raised pyarrow's own error out of `run_job`: now such
    rows are staged as JSON Lines and validated as that file would be — a prompt of the wrong type is its
    row's `bad_type` error row, ids of mixed types refuse the job (exit 2) naming the types."""
    import pandas as pd

    from flashx_batch.runner.in_memory import run_job

    def args(out):
        return [a for a in overrides(tiny_model_dir(), "unused", out, "executor.kind=local")
                if not a.startswith("data.path=")]

    stage = str(tmp_path / "stage")
    for i, frame in enumerate((pd.DataFrame({"id": [1, 2, 3], "prompt": ["the licence", 2, "copying"]}),
                               {"id": [1, 2], "prompt": ["the licence", HUGE]})):
        out = tmp_path / f"out{i}"
        assert run_job(args(out), data=frame, staging_dir=stage) == 0
        assert {k: code for k, (code, _) in _errors(out).items()} == {2: "bad_type"}
        assert set(_generated(out)) == ({1, 3} if i == 0 else {1})
    caplog.clear()
    mixed_ids = pd.DataFrame({"id": [1, "b", 3], "prompt": ["a", "b", "c"]})
    assert run_job(args(tmp_path / "out-ids"), data=mixed_ids, staging_dir=stage) == 2
    assert "column 'id' mixes types: int" in caplog.text and "Traceback" not in caplog.text
    assert not (tmp_path / "out-ids").exists()


def test_job_wide_n_with_openai_batch_files_is_refused_before_the_output():
    """sampling.n=2 once gave every OpenAI response two choices though each request asked for one, while
    the one line asking n: 2 was refused: now the job is refused (exit 2) before it writes anything."""
    import pytest

    from flashx_batch.errors import ConfigError

    for fmt in ("data.format=openai_batch", "output.format=openai_batch"):
        with pytest.raises(ConfigError, match="sampling.n=2 with OpenAI Batch files"):
            compose_job(overrides(tiny_model_dir(), "in.jsonl", None, fmt, "sampling.n=2", "sampling.temperature=0.7"))


def test_the_smaller_cases(tmp_path, caplog):
    """max_tokens and max_completion_tokens that disagree are refused (which would win was undocumented);
    a directory's files of no format we read are named in a warning, not skipped silently; the errors of
    a job not yet finished with no error rows have the error columns, as a finished job's do."""
    import logging

    from flashx_batch import read_output
    from flashx_batch.data.readers import resolve_inputs

    cols = openai_batch.parse("f.jsonl", "\n".join(json.dumps(x) for x in [
        _line("a", max_tokens=3, max_completion_tokens=4), _line("b", max_tokens=3, max_completion_tokens=3)]).encode())
    problems = dict(zip(cols["custom_id"], cols["request_error"]))
    assert "disagree" in problems["a"] and problems["b"] is None

    folder = tmp_path / "in"
    folder.mkdir()
    _write(folder / "rows.jsonl", [{"id": 1, "prompt": "the licence"}])
    for name in ("more.jsonl.gz", "notes.txt", "table.tsv"):
        (folder / name).write_bytes(b"x")
    with caplog.at_level(logging.WARNING):
        files = resolve_inputs(str(folder), "auto")
    assert [f.path.rsplit("/", 1)[-1] for f in files] == ["rows.jsonl"]
    assert "3 file(s) skipped" in caplog.text and ".jsonl.gz" in caplog.text and ".tsv" in caplog.text

    out = tmp_path / "out"
    assert _run(_write(tmp_path / "ok.jsonl", [_line("x"), _line("y")]), out) == 0
    (out / "_SUCCESS").unlink()  # as a job still running reads
    errors = read_output(out, "errors").to_table()
    assert errors.num_rows == 0 and errors.column_names == ["id", "error_code", "error_message", "stage"]


def test_a_job_planned_under_earlier_row_rules_stays_finished_or_is_refused(tmp_path, caplog):
    """The per-row checks changed (rows that were generated are error rows now, a line without an id is
    named otherwise): a finished job written before them is still already done, nothing rewritten; an
    unfinished one is refused (exit 2) rather than resumed into a plan with other ids."""
    from flashx_batch.runner import fingerprint

    data = _write(tmp_path / "in.jsonl", [_line(f"r{i}") for i in range(3)])
    out = tmp_path / "out"
    assert _run(data, out) == 0
    record = json.loads((out / "job.json").read_text())
    del record["fingerprint"][fingerprint.ROW_RULES_KEY]  # as a job.json from before the key
    (out / "job.json").write_text(json.dumps(record))
    stamp = (out / "_SUCCESS").stat().st_mtime_ns
    assert _run(data, out) == 0 and (out / "_SUCCESS").stat().st_mtime_ns == stamp
    (out / "_SUCCESS").unlink()
    record["status"] = "running"
    (out / "job.json").write_text(json.dumps(record))
    assert _run(data, out) == 2 and "checks rows as the job's did not" in caplog.text


def test_staged_rows_keep_their_types_and_paths_their_roots(tmp_path):
    """Rows staged as JSON Lines keep list cells as lists (pandas gives numpy arrays), bytes as their text
    (invalid bytes: an `invalid_text` row, as from a binary Parquet column); a value JSON has no type for
    is refused by column. `hdfs:///path` (the default namenode) is a path, not a missing bucket."""
    import datetime

    import numpy as np
    import pytest

    from flashx_batch import storage
    from flashx_batch.errors import ConfigError
    from flashx_batch.runner.in_memory import stage_lines

    path = stage_lines([{"id": 1, "messages": np.array([{"role": "user", "content": "hi"}], dtype=object),
                         "tags": np.array(["a", "b"]), "prompt": b"the licence \xff", "n": np.int64(3)}],
                       str(tmp_path))
    row = json.loads(open(path).read())
    assert row["messages"] == [{"role": "user", "content": "hi"}] and row["tags"] == ["a", "b"] and row["n"] == 3
    assert row["prompt"] == "the licence \udcff"
    with pytest.raises(ConfigError, match="column 'when' row 0 holds a datetime value"):
        stage_lines([{"when": datetime.datetime(2026, 1, 1)}], str(tmp_path))
    assert storage.normalize("hdfs:///data//in/./x") == "hdfs:///data/in/x"


def test_resolved_run_reads_an_accelerator_s_default_dtype_from_the_device(monkeypatch):
    """cuda / rocm / npu choose their default dtype per device (a property): `resolved_run` asks the
    backend instance, never the class (whose attribute is the property object itself)."""
    import torch

    from flashx_batch import backends

    class Device(backends.Backend):
        name = "gpu-like"

        @property
        def default_dtype(self):  # type: ignore[override]
            return torch.bfloat16

    monkeypatch.setattr(backends, "get_backend", lambda name: Device())
    assert backends.resolved_run("auto", "auto") == "gpu-like/bfloat16"
    assert backends.resolved_run("auto", "float16") == "gpu-like/float16"
