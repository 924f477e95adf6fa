"""task=embed as a job: the bundled sample embedded, every id once with a vector of the model's width; the
vectors are `Engine.embed`'s; a driver killed between a shard's publish and its manifest resumes to every
id exactly once; settings a vector job cannot use are refused."""

from __future__ import annotations

import signal

import pyarrow.parquet as pq
import pytest
import torch
from batch_support import cli, faults_override

from flashx_batch import Engine, run_job
from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner.job import plan_job

BASE = ["conf=legal_docs", "task=embed", "runtime.long_input=truncate", "runtime.shard_size=32"]


def _ids_once(out) -> list:
    ids = pq.read_table(out / "generations").column("id").to_pylist()
    assert len(ids) == len(set(ids))
    return ids


def test_the_bundled_sample_embedded_once_each(tmp_path):
    out = tmp_path / "out"
    assert run_job([*BASE, f"output.dir={out}", "executor.kind=local", "embed.pooling=mean",
                    "embed.dimensions=64"]) == 0
    table = pq.read_table(out / "generations")
    assert sorted(_ids_once(out)) == sorted(pq.read_table(
        "flashx_batch/assets/data/legal_docs.parquet").column("id").to_pylist())
    assert str(table.schema.field("embedding").type) == "fixed_size_list<element: float>[64]"
    stats = pq.read_table(out / "stats").to_pylist()
    assert {s["embedding_dim"] for s in stats} == {64}
    # the vectors are the engine's own for the same texts
    rows = {r["id"]: r for r in table.to_pylist()}
    source = pq.read_table("flashx_batch/assets/data/legal_docs.parquet").to_pylist()[:5]
    engine = Engine.from_pretrained(None, long_input="truncate")
    want = engine.embed([r["prompt"] for r in source], pooling="mean", dimensions=64)
    got = torch.tensor([rows[r["id"]]["embedding"] for r in source])
    assert torch.allclose(got, want, atol=1e-4)
    assert all(rows[r["id"]]["source"] == r["source"] for r in source)  # the preset's passthrough column


def test_killed_between_publish_and_manifest_then_resumed(tmp_path):
    out = tmp_path / "out"
    args = [*BASE, f"output.dir={out}", "executor.kind=local"]
    victim = plan_job(compose_job(args)).plan.shards[1].shard_id
    crashed = cli([*args, faults_override([f"crash:at=after_publish:shard={victim}"])], cwd=tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    resumed = cli(args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(_ids_once(out)) == 120


@pytest.mark.parametrize("extra, message", [
    (["data.messages_column=messages"], "task=embed reads text"),
    (["sampling.n=2", "sampling.temperature=1"], "generates none"),
    (["embed.pooling=max"], "embed.pooling='max'"),
    (["embed.dimensions=0"], "embed.dimensions=0"),
])
def test_settings_a_vector_job_cannot_use_are_refused(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        plan_job(compose_job([*BASE, f"output.dir={tmp_path}", *extra]))
