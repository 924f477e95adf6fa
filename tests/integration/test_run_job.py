"""`run_job` from Python: a pandas DataFrame, a `datasets.Dataset` and a pyarrow Table give the same
generations as the same rows from a Parquet file; the same data is staged once, so a rerun resumes."""

from __future__ import annotations

import datasets
import pandas as pd
import pyarrow as pa
import pytest
from batch_support import generations, overrides, sample_rows, tiny_model_dir, write_parquet

from flashx_batch import run_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner.in_memory import as_arrow

ROWS = sample_rows(12, seed=3)
LOCAL = ("executor.kind=local", "sampling.max_new_tokens=8")


@pytest.fixture(scope="module")
def from_parquet(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet")
    data = write_parquet(root / "in.parquet", ROWS)
    assert run_job(overrides(tiny_model_dir(), data, root / "out", *LOCAL)) == 0
    return generations(root / "out")


@pytest.mark.parametrize("kind", ["pandas", "datasets", "arrow"])
def test_in_memory_rows_give_the_parquet_generations(kind, from_parquet, tmp_path):
    table = {"pandas": lambda: pd.DataFrame(ROWS), "datasets": lambda: datasets.Dataset.from_list(ROWS),
             "arrow": lambda: pa.Table.from_pylist(ROWS)}[kind]()
    base = [a for a in overrides(tiny_model_dir(), "unused", tmp_path / "out", *LOCAL) if not a.startswith("data.path")]
    stage = tmp_path / "stage"
    assert run_job(base, data=table, staging_dir=str(stage)) == 0
    assert generations(tmp_path / "out") == from_parquet
    staged = sorted(stage.iterdir())
    assert len(staged) == 1
    before = staged[0].stat().st_mtime_ns
    assert run_job(base, data=table, staging_dir=str(stage)) == 0  # the same data: found, not rewritten; resumed
    assert [p.stat().st_mtime_ns for p in stage.iterdir()] == [before]


def test_a_shuffled_dataset_is_staged_as_its_rows_read(tmp_path):
    ds = datasets.Dataset.from_list(ROWS).shuffle(seed=1).select(range(5))
    assert as_arrow(ds).column("id").to_pylist() == [r["id"] for r in ds]


def test_what_run_job_refuses(tmp_path, caplog):
    with pytest.raises(ConfigError, match="takes a pyarrow Table"):
        as_arrow([1, 2, 3])
    job = overrides(tiny_model_dir(), "unused", tmp_path / "out", "executor.kind=ray", "executor.address=auto")
    # a refusal is an exit code, as on the command line (2: the job can never run as given)
    assert run_job([a for a in job if not a.startswith("data.path")], data=pd.DataFrame(ROWS)) == 2
    assert "pass staging_dir=" in caplog.text


def test_a_ray_dataset_gives_the_parquet_generations(from_parquet, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        import ray.data

        ds = ray.data.from_arrow(pa.Table.from_pylist(ROWS))
        base = [a for a in overrides(tiny_model_dir(), "unused", tmp_path / "out", *LOCAL)
                if not a.startswith("data.path")]
        assert run_job(base, data=ds, staging_dir=str(tmp_path / "stage")) == 0
    finally:
        ray.shutdown()
    assert generations(tmp_path / "out") == from_parquet
