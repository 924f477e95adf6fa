"""The commit protocol and resume bookkeeping of the output directory, and the fingerprint diff."""

from __future__ import annotations

import pyarrow as pa
import pytest

from flashx_batch.job_errors import OutputDirError
from flashx_batch.runner.fingerprint import diff
from flashx_batch.runner.layout import OutputDir
from flashx_batch.runner.signals import StopFlag


def _table(ids):
    return pa.table({"id": pa.array(ids, pa.int64())})


def test_commit_is_exclusive_and_complete(tmp_path):
    out = OutputDir(tmp_path / "o")
    out.prepare()
    assert out.commit("s1", 1, {"generations": _table([1, 2])}, {"rows": 2})
    # a second attempt of the same shard loses and leaves the winner's files alone
    assert not out.commit("s1", 2, {"generations": _table([9])}, {"rows": 1})
    assert set(out.committed()) == {"s1"} and out.committed()["s1"]["attempt"] == 1
    assert sum(out.read_ids("generations", {"s1"}).values()) == 2
    assert not any((tmp_path / "o" / "_attempts").iterdir())


def test_orphans_of_a_crash_are_removed(tmp_path):
    out = OutputDir(tmp_path / "o")
    out.prepare()
    out.commit("done", 1, {"generations": _table([1])}, {})
    out.start_attempt("half", 1)  # crashed while generating
    (tmp_path / "o" / "generations" / "part-half.parquet").write_bytes(b"renamed before the manifest")
    assert set(out.committed()) == {"done"}
    removed = out.clean_orphans(out.committed())
    assert removed == 2
    assert [p.name for p in (tmp_path / "o" / "generations").iterdir()] == ["part-done.parquet"]


def test_a_commit_missing_its_files_is_redone(tmp_path):
    out = OutputDir(tmp_path / "o")
    out.prepare()
    out.commit("s", 1, {"generations": _table([1]), "stats": _table([0])}, {})
    (tmp_path / "o" / "stats" / "part-s.parquet").unlink()
    assert out.committed() == {}


def test_foreign_directory_and_lock(tmp_path):
    (tmp_path / "mine.txt").write_text("not a job")
    with pytest.raises(OutputDirError, match="not empty"):
        OutputDir(tmp_path).read_job()
    a, b = OutputDir(tmp_path / "job"), OutputDir(tmp_path / "job")
    a.lock()
    with pytest.raises(OutputDirError, match="another run"):
        b.lock()
    a.unlock()
    b.lock()
    b.unlock()


def test_fingerprint_diff_names_fields():
    old = {"sampling.temperature": 0.0, "model.files": "abc", "runtime.shard_size": 4}
    new = {"sampling.temperature": 0.7, "model.files": "abc", "runtime.shard_size": 4, "data.limit": None}
    fields = diff(old, new)
    assert [f.split(":")[0] for f in fields] == ["data.limit", "sampling.temperature"]
    assert "0.0 -> 0.7" in fields[1]


def test_stop_flag_exit_codes():
    import signal

    flag = StopFlag(grace_period_s=60)
    assert not flag.requested and flag.exit_code == 0
    flag.request(signal.SIGTERM)
    assert flag.requested and flag.exit_code == 143
    flag.uninstall()
    flag = StopFlag(grace_period_s=60)
    flag.request(signal.SIGINT)
    assert flag.exit_code == 130
    flag.uninstall()


def test_progress_bar_on_a_tty_and_log_lines_otherwise(caplog):
    import io
    import logging

    from flashx_batch.runner.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = Progress(total_rows=10, stream=tty)
    bar.advance(4, 40)
    bar.close()
    assert "4/10 rows" in tty.getvalue() and "out tok/s" in tty.getvalue() and "ETA" in tty.getvalue()
    plain = io.StringIO()
    with caplog.at_level(logging.INFO, logger="flashx_batch.runner.progress"):
        Progress(total_rows=10, stream=plain).advance(10, 5)
    assert plain.getvalue() == "" and "10/10 rows" in caplog.text


def test_progress_off_a_tty_is_rate_limited(caplog):
    """Off a TTY: a line each 5 % of the rows (or each interval), not one per shard."""
    import io
    import logging

    from flashx_batch.runner.progress import Progress

    with caplog.at_level(logging.INFO, logger="flashx_batch.runner.progress"):
        progress = Progress(total_rows=20_000, interval_s=1e9, stream=io.StringIO())
        for _ in range(1250):  # 1,250 shards of 16 rows
            progress.advance(16, 100)
    lines = [r for r in caplog.records if "progress:" in r.getMessage()]
    assert 18 <= len(lines) <= 21 and "20000/20000 rows" in lines[-1].getMessage()
