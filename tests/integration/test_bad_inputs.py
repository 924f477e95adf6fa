"""The bad-input fixture: every kind of dirty input gets its documented outcome —
an error row with its code while the rest of the job runs, or exit 2 before anything is written.
The tables below are the ones in docs/reliability.md."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_support import cli, overrides, tiny_model_dir, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner import run

GOOD = "the licence permits copying"
# Row-level kinds: one JSONL line each (raw bytes, so invalid UTF-8 can be written), and the error code.
ROW_KINDS = {
    "null": (b'{"id": 1, "prompt": null}', "null_prompt"),
    "empty": (b'{"id": 2, "prompt": ""}', "empty_prompt"),
    "whitespace": (b'{"id": 3, "prompt": "  \\n\\t "}', "empty_prompt"),
    "non-string (number)": (b'{"id": 4, "prompt": 42}', "bad_type"),
    "non-string (list)": (b'{"id": 5, "prompt": ["a", "b"]}', "bad_type"),
    "lone surrogate": (b'{"id": 6, "prompt": "the \\ud800 licence"}', "invalid_text"),
    "invalid UTF-8 bytes": (b'{"id": 7, "prompt": "the \xff\xfe licence"}', "invalid_text"),
    "control character": (b'{"id": 8, "prompt": "the \\u0007 licence"}', "invalid_text"),
    "huge row": (json.dumps({"id": 9, "prompt": "licence " * 1000}).encode(), "row_too_large"),
    "too long for the context": (json.dumps({"id": 10, "prompt": "licence " * 400}).encode(), "prompt_too_long"),
}
GOOD_IDS = [100, 101, 102]


@pytest.fixture(scope="module")
def model():
    return tiny_model_dir()


def test_row_level_kinds_become_error_rows_and_the_rest_runs(model, tmp_path):
    lines = [line for line, _ in ROW_KINDS.values()]
    lines += [json.dumps({"id": i, "prompt": f"{GOOD} {i}"}).encode() for i in GOOD_IDS]
    data = tmp_path / "dirty.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    assert run(compose_job(overrides(model, data, out, "data.max_row_bytes=4000", "runtime.max_input_len=256"))) == 0
    errors = pq.read_table(out / "errors").to_pylist()
    got = {r["id"]: r["error_code"] for r in errors}
    want = {json.loads(line.decode("utf-8", "surrogateescape"))["id"]: code for line, code in ROW_KINDS.values()}
    assert got == want
    assert all(r["error_message"] and r["stage"] in ("validate", "tokenize") for r in errors)
    assert sorted(pq.read_table(out / "generations").column("id").to_pylist()) == GOOD_IDS
    record = json.loads((out / "job.json").read_text())
    assert record["accounting"] == {"input_rows": 13, "generated_rows": 3, "error_rows": 10, "pending_rows": 0,
                                    "committed_pieces": record["accounting"]["committed_pieces"]}


def _parquet(path, rows, schema=None):
    return write_parquet(path, rows, schema)


def _corrupt_footer(path):
    _parquet(path, [{"id": i, "prompt": GOOD} for i in range(4)])
    raw = bytearray(path.read_bytes())
    raw[-8:-4] = b"\xff\xff\xff\x7f"  # footer length far past the file: the metadata cannot be read
    path.write_bytes(bytes(raw))
    return path


# Job-level kinds: (how to build the input, extra overrides, a phrase the error names) -> exit 2, nothing written.
JOB_KINDS = {
    "duplicate ids": (lambda p: _parquet(p, [{"id": 1, "prompt": GOOD}, {"id": 1, "prompt": GOOD}]), "duplicated"),
    "missing column": (lambda p: _parquet(p, [{"id": 1, "text": GOOD}]), "missing column"),
    "wrong type": (lambda p: _parquet(p, [{"id": 1, "prompt": 5}]), "expected strings"),
    "null id": (lambda p: _parquet(p, [{"id": None, "prompt": GOOD}, {"id": 2, "prompt": GOOD}],
                                   pa.schema([("id", pa.int64()), ("prompt", pa.string())])), "every row needs an id"),
    "corrupt Parquet footer": (_corrupt_footer, "cannot read as parquet"),
    "empty file": (lambda p: (p.write_bytes(b""), p)[1], "empty file"),
    "not JSON (jsonl)": (lambda p: (p.with_suffix(".jsonl").write_text('{"id": 1, "prompt": "a"}\n{oops\n'),
                                    p.with_suffix(".jsonl"))[1], "not valid JSON"),
    "mixed id types": (lambda p: (p.with_suffix(".jsonl").write_text('{"id": 1, "prompt": "a"}\n'
                                                                       '{"id": "x", "prompt": "b"}\n'),
                                  p.with_suffix(".jsonl"))[1], "mixes types"),
}


@pytest.mark.parametrize("kind", list(JOB_KINDS))
def test_job_level_kinds_exit_2_before_anything_runs(model, tmp_path, kind, caplog):
    build, phrase = JOB_KINDS[kind]
    data = build(tmp_path / "bad.parquet")
    out = tmp_path / "out"
    assert run(compose_job(overrides(model, data, out))) == 2
    assert phrase in caplog.text
    assert not out.exists()


@pytest.mark.parametrize("override, phrase", [("sampling.temprature=0.5", "temprature"),
                                              ("sampling.max_new_tokens=0", "max_new_tokens must be >= 1"),
                                              ("sampling.max_new_tokens=-3", "max_new_tokens must be >= 1")])
def test_bad_sampling_settings_are_config_errors(model, tmp_path, override, phrase):
    with pytest.raises(ConfigError, match=phrase):  # the CLI maps ConfigError to exit 2
        compose_job(overrides(model, tmp_path / "x.parquet", tmp_path / "out", override))


def test_cli_exits_2_on_max_new_tokens_0(model, tmp_path):
    data = _parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": GOOD}])
    proc = cli(overrides(model, data, tmp_path / "out", "sampling.max_new_tokens=0"), cwd=tmp_path)
    assert proc.returncode == 2 and "max_new_tokens" in proc.stderr
    assert not (tmp_path / "out").exists()
