"""Readers, preflight (whole-job problems → InputError naming the culprit) and per-row error codes."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
from batch_support import sample_rows, tiny_model_dir, write_parquet

from flashx_batch.config import DataSection, compose_job
from flashx_batch.data import load_inputs, plan_prompts
from flashx_batch.job_errors import InputError
from flashx_batch.runtime.tokenizer import Tokenizer


def _data(**kw) -> DataSection:
    return DataSection(path="unused", **kw)


# ---- readers ---------------------------------------------------------------------------------
def test_reads_parquet_jsonl_csv_dirs_and_globs(tmp_path):
    rows = sample_rows(6)
    write_parquet(tmp_path / "d" / "a.parquet", rows[:3])
    with open(tmp_path / "d" / "b.jsonl", "w") as fh:
        for r in rows[3:5]:
            fh.write(json.dumps(r) + "\n")
    pacsv.write_csv(pa.Table.from_pylist([{**rows[5], "id": str(rows[5]["id"])}]), tmp_path / "c.csv")
    loaded = load_inputs(_data(), str(tmp_path / "d"))
    assert [len(f.columns["id"]) for f in loaded.frames] == [3, 2]
    assert load_inputs(_data(), str(tmp_path / "d" / "*.jsonl")).frames[0].columns["id"] == [3, 4]
    csv = load_inputs(_data(), str(tmp_path / "c.csv"))
    assert csv.id_kind == "str" and csv.frames[0].columns["prompt"] == [rows[5]["prompt"]]


def test_reads_datasets_save_to_disk(tmp_path):
    import datasets

    datasets.Dataset.from_list(sample_rows(4)).save_to_disk(str(tmp_path / "ds"))
    loaded = load_inputs(_data(), str(tmp_path / "ds"))
    assert sum(f.num_rows for f in loaded.frames) == 4 and loaded.id_kind == "int"


# ---- preflight: exit-2 problems, each message names what is wrong ------------------------------
def _bad_inputs(tmp_path):
    write_parquet(tmp_path / "nocol.parquet", [{"id": 1, "text": "x"}])
    write_parquet(tmp_path / "inttext.parquet", [{"id": 1, "prompt": 5}])
    write_parquet(tmp_path / "floatid.parquet", [{"id": 1.5, "prompt": "x"}])
    write_parquet(tmp_path / "nullid.parquet", [{"id": None, "prompt": "x"}, {"id": 2, "prompt": "y"}],
                  pa.schema([("id", pa.int64()), ("prompt", pa.string())]))
    write_parquet(tmp_path / "dup" / "a.parquet", [{"id": 7, "prompt": "x"}, {"id": 8, "prompt": "y"}])
    write_parquet(tmp_path / "dup" / "b.parquet", [{"id": 7, "prompt": "z"}])
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "broken.jsonl").write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": \n')
    return tmp_path


@pytest.mark.parametrize("name, fragments", [
    ("missing.parquet", ["missing.parquet", "no such file"]),
    ("nothing-*.parquet", ["matches no files"]),
    ("nocol.parquet", ["nocol.parquet", "prompt", "missing column"]),
    ("inttext.parquet", ["inttext.parquet", "'prompt'", "int64"]),
    ("floatid.parquet", ["floatid.parquet", "'id'", "double"]),
    ("nullid.parquet", ["nullid.parquet", "null"]),
    ("dup", ["duplicated", "7", "a.parquet", "b.parquet"]),
    ("corrupt.parquet", ["corrupt.parquet", "cannot read"]),
    ("empty.parquet", ["empty.parquet", "empty"]),
    ("broken.jsonl", ["broken.jsonl:2", "not valid JSON"]),
])
def test_preflight_names_the_problem(tmp_path, name, fragments):
    root = _bad_inputs(tmp_path)
    with pytest.raises(InputError) as info:
        load_inputs(_data(), str(root / name))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


# ---- per-row error codes ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(tiny_model_dir())


def _plan(tmp_path, lines: list[str], tokenizer, *overrides):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(line.encode("utf-8", "surrogateescape") for line in lines) + b"\n")
    job = compose_job(["conf=smoke", f"data.path={path}", "data.limit=null", "data.passthrough_columns=[]",
                       "data.passthrough_if_present=[]",
                       f"model.path={tiny_model_dir()}", *overrides])
    loaded = load_inputs(job.data, str(path))
    return plan_prompts(job, loaded, tokenizer)


def test_each_error_code(tmp_path, tokenizer):
    long_prompt = " ".join(["licence"] * 600)
    lines = [
        '{"id": "ok", "prompt": "the licence permits copying"}',
        '{"id": "null", "prompt": null}',
        '{"id": "missing"}',
        '{"id": "empty", "prompt": "   "}',
        '{"id": "type", "prompt": 42}',
        '{"id": "list", "prompt": ["a"]}',
        '{"id": "surrogate", "prompt": "bad \\ud800 text"}',
        '{"id": "control", "prompt": "bell \\u0007 here"}',
        '{"id": "bytes", "prompt": "caf\udce9"}',  # a raw 0xE9 byte: invalid UTF-8 in the file
        f'{{"id": "long", "prompt": "{long_prompt}"}}',
        f'{{"id": "huge", "prompt": "{"x" * 7000}"}}',
    ]
    plan = _plan(tmp_path, lines, tokenizer, "data.max_row_bytes=6000")
    codes = {e.id: e.code for errs in plan.row_errors.values() for e in errs}
    assert codes == {"null": "null_prompt", "missing": "null_prompt", "empty": "empty_prompt", "type": "bad_type",
                     "list": "bad_type", "surrogate": "invalid_text", "control": "invalid_text",
                     "bytes": "invalid_text", "long": "prompt_too_long", "huge": "row_too_large"}
    assert plan.num_valid == 1 and plan.num_rows == len(lines)
    stages = {e.id: e.stage for errs in plan.row_errors.values() for e in errs}
    assert stages["long"] == "tokenize" and stages["null"] == "validate"


def test_truncate_keeps_long_rows(tmp_path, tokenizer):
    long_prompt = " ".join(["licence"] * 600)
    plan = _plan(tmp_path, [f'{{"id": 1, "prompt": "{long_prompt}"}}'], tokenizer, "runtime.long_input=truncate")
    assert plan.num_valid == 1 and not plan.error_counts


def test_messages_column_uses_the_chat_template(tmp_path, tokenizer):
    lines = [
        '{"id": 1, "messages": [{"role": "user", "content": "the licence"}]}',
        '{"id": 2, "messages": "not json"}',
        '{"id": 3, "messages": [{"content": "no role"}]}',
        '{"id": 4, "messages": []}',
    ]
    plan = _plan(tmp_path, lines, tokenizer, "data.messages_column=messages")
    codes = {e.id: e.code for errs in plan.row_errors.values() for e in errs}
    assert codes == {2: "bad_type", 3: "bad_type", 4: "empty_prompt"}
    assert plan.num_valid == 1
    expected = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "the licence"}])))
    assert plan.shards[0].input_tokens == expected


# ---- workers read their rows by row group -----------------------------------------------------
def test_read_rows_reads_only_the_row_groups_it_needs(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from flashx_batch.data.readers import read_rows, resolve_inputs
    from flashx_batch.job_errors import InputChangedError

    path = tmp_path / "groups.parquet"
    pq.write_table(pa.table({"id": list(range(100)), "prompt": [f"p{i}" for i in range(100)]}), path,
                   row_group_size=32)
    (file,) = resolve_inputs(str(path))
    read_groups = []
    real = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: read_groups.append(list(groups)) or real(self, groups, **kw))
    frame, position = read_rows(file, ["id", "prompt"], [70, 3, 5])
    assert read_groups == [[0, 2]]  # rows 3 and 5 in group 0, row 70 in group 2: group 1 is never read
    assert frame.num_rows == 3 and [frame.columns["prompt"][position[r]] for r in (70, 3, 5)] == ["p70", "p3", "p5"]
    pq.write_table(pa.table({"id": list(range(101)), "prompt": [f"p{i}" for i in range(101)]}), path)
    with pytest.raises(InputChangedError):
        read_rows(file, ["id", "prompt"], [3])
