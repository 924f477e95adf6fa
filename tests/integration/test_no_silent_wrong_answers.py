"""Paths where a job used to exit 0 with wrong content, or give a scheduler the wrong exit code.

One test (or a few) per kind: output columns shadowed by passthrough columns, input changed during a
run, two runs deciding on one directory, chat turns the template drops, non-finite settings,
failures found only at engine load, ids beyond int64, signals at any moment, tracebacks for user or
environment mistakes, one bad CSV row, misleading messages, worker errors without their cause, and
the scheduler signals of a finished job and of a held lock. docs/reliability.md has the tables.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from batch_support import (
    cli,
    faults_override,
    output_ids,
    overrides,
    sample_rows,
    tiny_model_dir,
    tree_snapshot,
    write_parquet,
)

from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner import run
from flashx_batch.runner.layout import OutputDir

LOCAL = "executor.kind=local"


@pytest.fixture(scope="module")
def model():
    return tiny_model_dir()


@pytest.fixture
def data(tmp_path):
    return write_parquet(tmp_path / "in" / "rows.parquet", sample_rows(12))


def _job(model, data, out, *extra):
    return compose_job(overrides(model, data, out, LOCAL, *extra))


def _status(out: Path) -> dict:
    return json.loads((out / "job.json").read_text())


class _SigtermGuard:
    """Stands in for the default SIGTERM action (which would kill pytest): raises where no handler of
    the runner's own is installed, so a run that leaves SIGTERM unhandled fails its test instead."""

    class Killed(Exception):
        pass

    def __enter__(self):
        def handler(signum, frame):
            raise self.Killed("SIGTERM reached the default action")

        self.previous = signal.signal(signal.SIGTERM, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.previous)


# ---- output columns are ours ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["generated_text", "finish_reason", "num_input_tokens", "num_generated_tokens",
                                  "shard_id", "error_code", "stage"])
def test_a_passthrough_column_named_like_an_output_column_is_refused(model, tmp_path, name, caplog):
    rows = [{**r, name: "user value"} for r in sample_rows(6)]
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    assert run(_job(model, data, out, f"data.passthrough_columns=[{name}]")) == 2
    assert repr(name) in caplog.text and "reserved" in caplog.text
    assert not out.exists()


def test_a_passthrough_column_named_id_beside_another_id_column_is_refused(model, tmp_path, caplog):
    rows = [{"doc": f"d{i}", "id": 7, "prompt": r["prompt"]} for i, r in enumerate(sample_rows(6))]
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    assert run(_job(model, data, out, "data.id_column=doc", "data.passthrough_columns=[id]")) == 2
    assert "'id'" in caplog.text and not out.exists()


# ---- input files cannot change under a job -----------------------------------------------------------
def _rewrite(path: Path) -> None:
    rows = [{**r, "prompt": "copyright holder " + r["prompt"]} for r in sample_rows(12)]
    write_parquet(path, rows)


@pytest.mark.parametrize("moment", ["before the first read", "after the worker read it"])
def test_an_input_file_replaced_mid_run_fails_the_job_cleanly(model, data, tmp_path, monkeypatch, caplog, moment):
    import flashx_batch.runner.worker as worker_module

    real = worker_module.read_rows  # Parquet rows are read by row group
    calls = []

    def read_then_replace(*args, **kwargs):
        calls.append(1)
        if moment == "before the first read" and len(calls) == 1:
            _rewrite(data)
        frame = real(*args, **kwargs)
        if moment == "after the worker read it" and len(calls) == 1:
            _rewrite(data)
        return frame

    monkeypatch.setattr(worker_module, "read_rows", read_then_replace)
    out = tmp_path / "out"
    assert run(_job(model, data, out, "runtime.shard_size=4")) == 2
    assert str(data) in caplog.text and "changed after the job was planned" in caplog.text
    assert not (out / "_SUCCESS").exists()
    assert _status(out)["status"] == "failed"


# ---- job.json is read and decided on under the lock ---------------------------------------------------
def test_a_second_run_cannot_adopt_the_shards_of_a_run_that_finished_while_it_hashed(model, data, tmp_path,
                                                                                      monkeypatch):
    """Run B hashes its model slowly; run A (other sampling) runs into the same directory meanwhile.
    B's output must be B's own generations (A was refused), never A's shards under B's job.json."""
    from flashx_batch.runner import fingerprint

    out, reference = tmp_path / "out", tmp_path / "reference"
    job_a = _job(model, data, out, "sampling.max_new_tokens=3")
    job_b = _job(model, data, out, "sampling.max_new_tokens=9")
    real = fingerprint.model_file_stats
    other: list[int] = []

    def slow_hash(*args, **kwargs):
        if not other:
            other.append(run(job_a))  # runs while B is between planning and its first look at job.json
        return real(*args, **kwargs)

    monkeypatch.setattr(fingerprint, "model_file_stats", slow_hash)
    assert run(job_b) == 0
    monkeypatch.setattr(fingerprint, "model_file_stats", real)
    assert other == [75]  # A found B's lock: try again later
    assert run(_job(model, data, reference, "sampling.max_new_tokens=9")) == 0
    tokens = {r["id"]: r["num_generated_tokens"] for r in pq.read_table(out / "generations").to_pylist()}
    want = {r["id"]: r["num_generated_tokens"] for r in pq.read_table(reference / "generations").to_pylist()}
    assert tokens == want
    assert _status(out)["config"]["sampling"]["max_new_tokens"] == 9


# ---- chat turns the template would drop -------------------------------------------------------------
def test_messages_with_roles_the_template_does_not_render_become_error_rows(model, tmp_path):
    rows = [
        {"id": 1, "messages": json.dumps([{"role": "usr", "content": "the licence permits copying"}])},
        {"id": 2, "messages": json.dumps([{"role": "user", "content": "the licence"},
                                          {"role": "tool", "content": "warranty liability"}])},
        {"id": 3, "messages": json.dumps([{"role": "user", "content": "the licence permits copying"}])},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    assert run(_job(model, data, out, "data.messages_column=messages")) == 0
    errors = {r["id"]: r for r in pq.read_table(out / "errors").to_pylist()}
    assert {i: e["error_code"] for i, e in errors.items()} == {1: "unrendered_message", 2: "unrendered_message"}
    assert "'usr'" in errors[1]["error_message"] and "'tool'" in errors[2]["error_message"]
    assert pq.read_table(out / "generations").column("id").to_pylist() == [3]


# ---- settings that are not numbers ---------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("sampling.temperature=nan", "sampling.temperature"), ("sampling.temperature=inf", "sampling.temperature"),
    ("sampling.top_p=nan", "sampling.top_p"), ("runtime.kv_merge_fraction=nan", "runtime.kv_merge_fraction"),
    ("executor.grace_period_s=-1", "executor.grace_period_s"),
    ("executor.progress_interval_s=-5", "executor.progress_interval_s"),
    ("executor.shard_timeout_s=inf", "executor.shard_timeout_s"),
])
def test_non_finite_or_negative_settings_are_refused_naming_the_key(model, tmp_path, override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        compose_job(overrides(model, tmp_path / "x.parquet", tmp_path / "out", override))


# ---- what an engine would refuse at load is found before output.dir is touched -----------------------
def _model_copy(model: Path, dst: Path) -> Path:
    shutil.copytree(model, dst)
    return dst


def _unsupported_architecture(model, tmp_path):
    m = _model_copy(model, tmp_path / "m")
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    return [f"model.path={m}"], "FooForCausalLM"


def _truncated_weights(model, tmp_path):
    m = _model_copy(model, tmp_path / "m")
    weights = m / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return [f"model.path={m}"], "truncated"


def _wrong_shape(model, tmp_path):
    m = _model_copy(model, tmp_path / "m")
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] + 8}))
    return [f"model.path={m}"], "does not match"


@pytest.mark.parametrize("make", [_unsupported_architecture, _truncated_weights, _wrong_shape,
                                  lambda model, tmp: (["runtime.backend=cuda"], "runtime.backend=cuda")],
                         ids=["architecture", "truncated safetensors", "shape", "cuda on a CPU machine"])
def test_load_failures_are_found_in_preflight_exit_2_and_touch_nothing(model, data, tmp_path, make, caplog):
    extra, phrase = make(model, tmp_path)
    out = tmp_path / "out"
    assert run(_job(model, data, out, *extra)) == 2
    assert phrase in caplog.text
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
    assert not out.exists()


def test_a_run_that_committed_no_generated_row_is_replaced_by_a_corrected_run(model, tmp_path):
    rows = sample_rows(6)
    rows[0]["prompt"] = None  # a plan-time error row: committed by the driver before any engine runs
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    # every try fails on a dead engine: exit 1, nothing generated committed
    assert run(_job(model, data, out, "executor.max_attempts=1", faults_override(["fatal"]))) == 1
    assert _status(out)["status"] == "failed"
    assert run(_job(model, data, out, "sampling.max_new_tokens=5")) == 0  # another fingerprint: replaces it
    generated, errors = output_ids(out)
    assert sorted(generated) == list(range(1, 6)) and list(errors) == [0]
    assert _status(out)["config"]["sampling"]["max_new_tokens"] == 5


# ---- ids Parquet cannot hold ---------------------------------------------------------------------------
@pytest.mark.parametrize("dry", [True, False])
def test_integer_ids_beyond_int64_exit_2_in_preflight(model, tmp_path, dry, caplog):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": 2**64 + 3, "prompt": "the licence"}) + "\n"
                    + json.dumps({"id": 1, "prompt": "the licence"}) + "\n")
    out = tmp_path / "out"
    assert run(_job(model, data, out, f"dry_run={str(dry).lower()}")) == 2
    assert "64-bit" in caplog.text and "strings" in caplog.text
    assert not out.exists()


# ---- signals at any moment -------------------------------------------------------------------------------
def test_sigterm_during_ray_start_up_exits_143_with_a_log_line(model, data, tmp_path, monkeypatch, caplog):
    import ray

    def init_then_sigterm(*args, **kwargs):  # what Ray's own handler does with a SIGTERM mid-start
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ray, "init", init_then_sigterm)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    out = tmp_path / "out"
    with _SigtermGuard():
        assert run(compose_job(overrides(model, data, out, "executor.kind=ray"))) == 143
    assert "SIGTERM" in caplog.text
    assert not out.exists()


def _sigterm_inside(monkeypatch, module, name: str):
    """Patch `module.name` to send this process SIGTERM, then do its work; returns the real one."""
    real = getattr(module, name)

    def sigterm_then_real(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, sigterm_then_real)
    return real


def test_sigterm_while_planning_exits_143_and_writes_nothing(model, data, tmp_path, monkeypatch):
    import flashx_batch.runner.job as job_module

    _sigterm_inside(monkeypatch, job_module, "load_inputs")
    out = tmp_path / "out"
    with _SigtermGuard():
        assert run(_job(model, data, out)) == 143
    assert not out.exists()


def test_sigterm_while_the_report_is_written_exits_143_with_accounting(model, data, tmp_path, monkeypatch):
    import flashx_batch.report as report_module

    real = _sigterm_inside(monkeypatch, report_module, "write_report")
    out = tmp_path / "out"
    with _SigtermGuard():
        assert run(_job(model, data, out)) == 143
    record = _status(out)
    assert record["status"] == "interrupted" and record["exit_code"] == 143
    assert record["accounting"]["input_rows"] == 12 and record["accounting"]["pending_rows"] == 0
    assert not (out / "_SUCCESS").exists()
    monkeypatch.setattr(report_module, "write_report", real)
    assert run(_job(model, data, out)) == 0 and (out / "_SUCCESS").exists()


# ---- user and environment mistakes: one clear line, never a traceback --------------------------------
def _no_traceback(caplog) -> bool:
    return "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)


def test_output_dir_that_is_a_regular_file(model, data, tmp_path, caplog):
    out = tmp_path / "out"
    out.write_text("not a directory")
    assert run(_job(model, data, out)) == 2
    assert "is a file" in caplog.text and _no_traceback(caplog)
    assert out.read_text() == "not a directory"


def test_output_dir_on_a_read_only_filesystem(model, data, tmp_path, monkeypatch, caplog):
    out = tmp_path / "ro" / "out"
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self == out or out in self.parents or self == out.parent:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert run(_job(model, data, out)) == 2
    assert "Read-only file system" in caplog.text and "cannot be written" in caplog.text and _no_traceback(caplog)


def test_csv_with_a_duplicated_header(model, tmp_path, caplog):
    data = tmp_path / "in.csv"
    data.write_text("id,prompt,prompt\n1,the licence,copying\n")
    assert run(_job(model, data, tmp_path / "out")) == 2
    assert "more than once" in caplog.text and _no_traceback(caplog)


def test_torn_job_json(model, data, tmp_path, caplog):
    out = tmp_path / "out"
    assert run(_job(model, data, out)) == 0
    text = (out / "job.json").read_text()
    (out / "job.json").write_text(text[: len(text) // 2])
    (out / "_SUCCESS").unlink()
    assert run(_job(model, data, out)) == 2  # committed shards, no record of their config: refuse
    assert "not valid JSON" in caplog.text and _no_traceback(caplog)
    caplog.clear()
    for name in ("_manifest", "generations", "errors", "stats"):  # nothing committed: start afresh
        shutil.rmtree(out / name)
    (out / "job.json").write_text(text[: len(text) // 3])
    assert run(_job(model, data, out)) == 0


def test_disk_full_while_writing_job_json(model, data, tmp_path, caplog):
    out = tmp_path / "out"
    assert run(_job(model, data, out, faults_override(["enospc:at=job_json:shard=succeeded"]))) == 1
    assert "No space left on device" in caplog.text and _no_traceback(caplog)
    record = _status(out)
    assert record["status"] == "failed" and "No space left" in record["reason"]
    assert record["accounting"]["pending_rows"] == 0 and not (out / "_SUCCESS").exists()
    assert run(_job(model, data, out)) == 0 and _status(out)["status"] == "succeeded"


# ---- one bad CSV row is one error row -------------------------------------------------------------------
def test_one_non_utf8_csv_row_is_an_invalid_text_error_row(model, tmp_path):
    data = tmp_path / "in.csv"
    data.write_bytes(b"id,prompt\n1,the licence permits copying\n2,the \xff\xfe licence\n3,warranty liability\n")
    out = tmp_path / "out"
    assert run(_job(model, data, out)) == 0
    assert {r["id"]: r["error_code"] for r in pq.read_table(out / "errors").to_pylist()} == {"2": "invalid_text"}
    assert sorted(pq.read_table(out / "generations").column("id").to_pylist()) == ["1", "3"]


# ---- messages that say what is wrong ------------------------------------------------------------------
def test_jsonl_with_a_utf8_bom_is_read(model, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + b"\n".join(json.dumps({"id": i, "prompt": "the licence"}).encode()
                                                  for i in range(3)) + b"\n")
    out = tmp_path / "out"
    assert run(_job(model, data, out)) == 0
    assert sorted(output_ids(out)[0]) == [0, 1, 2]


def test_float_ids_are_named_as_floats(model, tmp_path, caplog):
    data = write_parquet(tmp_path / "in.parquet", [{"id": 1.0, "prompt": "a"}, {"id": 2.5, "prompt": "b"}])
    assert run(_job(model, data, tmp_path / "out")) == 2
    assert "double" in caplog.text or "float" in caplog.text
    assert "mixes" not in caplog.text
    caplog.clear()
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": 1.0, "prompt": "a"}\n{"id": 2.5, "prompt": "b"}\n')
    assert run(_job(model, data, tmp_path / "out")) == 2
    assert "float" in caplog.text and "mixes" not in caplog.text


def test_a_bad_model_dtype_is_reported_as_model_dtype(model, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.dtype='float8'"):
        compose_job(overrides(model, tmp_path / "x.parquet", tmp_path / "out", "model.dtype=float8"))


def test_a_resume_refused_for_changed_input_names_the_file_and_the_change(model, tmp_path, caplog):
    write_parquet(tmp_path / "in" / "a.parquet", sample_rows(4))
    out = tmp_path / "out"
    assert run(_job(model, tmp_path / "in", out, "executor.max_attempts=1", faults_override(["fatal"]))) == 1
    write_parquet(tmp_path / "in" / "a.parquet", sample_rows(4, seed=5))
    write_parquet(tmp_path / "in" / "b.parquet", [{**r, "id": r["id"] + 100} for r in sample_rows(2)])
    (out / "_manifest").mkdir(exist_ok=True)
    # make the earlier run non-replaceable: one committed generate piece
    (out / "_manifest" / "b00-0000-x.json").write_text(json.dumps({"shard_id": "b00-0000-x", "files": [],
                                                                    "kind": "generate"}))
    assert run(_job(model, tmp_path / "in", out)) == 2
    assert "input file a.parquet: changed" in caplog.text and "input file b.parquet: new" in caplog.text


def test_output_dir_inside_the_input_directory_is_refused(model, tmp_path, caplog):
    write_parquet(tmp_path / "in" / "a.parquet", sample_rows(4))
    out = tmp_path / "in" / "out"
    assert run(_job(model, tmp_path / "in", out)) == 2
    assert "inside data.path" in caplog.text and not out.exists()


# ---- scheduler signals ----------------------------------------------------------------------------------
def test_rerunning_a_finished_job_leaves_success_and_job_json_untouched(model, data, tmp_path):
    out = tmp_path / "out"
    assert run(_job(model, data, out)) == 0
    before = tree_snapshot(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert run(_job(model, data, out)) == 0
    assert tree_snapshot(out) == before
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == mtimes


def test_a_lock_held_by_a_live_run_exits_75(model, data, tmp_path, caplog):
    out = tmp_path / "out"
    holder = OutputDir(out)
    holder.lock()
    try:
        assert run(_job(model, data, out)) == 75
    finally:
        holder.unlock()
    assert "another run" in caplog.text
    proc = cli(overrides(model, data, out, LOCAL), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


# ---- worker errors reach the user whole, under Ray ------------------------------------------------------
def test_ray_worker_errors_arrive_as_data_with_type_message_frames_node(model, data, tmp_path):
    out = tmp_path / "out"
    proc = cli(overrides(model, data, out, "executor.kind=ray", "executor.num_actors=1", "executor.max_attempts=2",
                         faults_override(["enospc:kind=generations"])), cwd=tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "\x1b[" not in proc.stderr  # no terminal colour codes
    assert "OSError: [Errno 28] No space left on device" in proc.stderr
    assert "innermost frames:" in proc.stderr
    failures = _status(out)["worker_failures"]
    assert failures and all(f["type"] == "OSError" and "No space left" in f["message"] for f in failures)
    assert all(f["frames"] and f["node"] and f["worker"] and f["attempt"] >= 1 for f in failures)
    assert any("layout.py" in frame for frame in failures[0]["frames"])


def test_npu_backend_under_ray_is_probed_before_output_dir_is_touched(model, data, tmp_path):
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=1, resources={"NPU": 1}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        out = tmp_path / "out"
        job = compose_job(overrides(model, data, out, "executor.kind=ray", "runtime.backend=npu"))
        assert run(job) == 2
        assert not out.exists()
    finally:
        ray.shutdown()


def test_a_backend_the_cluster_lacks_is_refused_before_output_dir_is_touched(model, data, tmp_path, caplog):
    out = tmp_path / "out"
    assert run(compose_job(overrides(model, data, out, "executor.kind=ray", "runtime.backend=cuda"))) == 2
    assert "GPU" in caplog.text and not out.exists()


# ---- found by review and the fuzz test ---------------------------------------------------------------
def test_upper_case_suffixes_in_an_input_directory_are_read_not_skipped(model, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.JSONL").write_text("\n".join(json.dumps({"id": i, "prompt": "the licence"})
                                                       for i in range(3)) + "\n")
    write_parquet(tmp_path / "in" / "b.Parquet", [{"id": 10, "prompt": "the licence"}])
    out = tmp_path / "out"
    assert run(_job(model, tmp_path / "in", out)) == 0
    assert sorted(output_ids(out)[0]) == [0, 1, 2, 10]


def test_a_recursive_glob_that_would_read_the_outputs_is_refused_before_the_first_run(model, tmp_path, caplog):
    write_parquet(tmp_path / "d" / "in" / "a.parquet", sample_rows(4))
    out = tmp_path / "d" / "out"
    assert run(_job(model, f"{tmp_path}/d/**/*.parquet", out)) == 2
    assert "inside data.path" in caplog.text and not out.exists()
    assert run(_job(model, f"{tmp_path}/d/in/*.parquet", out)) == 0  # a glob that cannot reach out/ is fine


def test_disk_full_after_a_failed_run_still_records_a_final_status(model, data, tmp_path):
    out = tmp_path / "out"
    assert run(_job(model, data, out, "executor.max_attempts=1", faults_override(["fatal"]))) == 1
    assert run(_job(model, data, out, faults_override(["enospc:at=job_json"]))) == 1  # every job.json write fails
    assert _status(out)["status"] == "failed"
    assert run(_job(model, data, out)) == 0


def test_a_piece_committed_for_another_job_is_redone(model, data, tmp_path, caplog):
    out = tmp_path / "out"
    assert run(_job(model, data, out)) == 0
    manifest = sorted((out / "_manifest").glob("b*.json"))[0]
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "job_digest": "from-a-replaced-job"}))
    (out / "_SUCCESS").unlink()
    assert run(_job(model, data, out)) == 0
    assert "committed by a run of another job" in caplog.text
    generated, errors = output_ids(out)
    assert sorted(generated + errors) == list(range(12)) and max((generated + errors).values()) == 1
    assert json.loads(manifest.read_text())["job_digest"] != "from-a-replaced-job"


def test_model_weights_replaced_mid_run_fail_the_job_cleanly(model, data, tmp_path, monkeypatch, caplog):
    import flashx_batch.runner.worker as worker_module

    m = _model_copy(model, tmp_path / "m")
    real = worker_module.read_rows

    def read_then_replace_weights(*args, **kwargs):
        weights = m / "model.safetensors"
        weights.write_bytes(weights.read_bytes())  # a new copy: same size, a new mtime
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_module, "read_rows", read_then_replace_weights)
    out = tmp_path / "out"
    assert run(_job(model, data, out, f"model.path={m}")) == 2
    assert "model.safetensors changed while the job ran" in caplog.text
    assert not (out / "_SUCCESS").exists() and _status(out)["status"] == "failed"


def test_a_signal_stops_a_whole_sweep_with_its_code(model, data, tmp_path, monkeypatch):
    import flashx_batch.cli as cli_module
    import flashx_batch.runner as runner_package

    calls = []
    monkeypatch.setattr(runner_package, "run", lambda job: calls.append(job.runtime.max_batch_size) or 143)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["flashx_batch", "-m", *overrides(model, data, tmp_path / "sweep", LOCAL),
                                      "runtime.max_batch_size=2,4,8"])
    with pytest.raises(SystemExit) as stopped:
        cli_module.main()
    assert stopped.value.code == 143 and calls == [2]  # the later points never started
