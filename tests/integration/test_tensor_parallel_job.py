"""Tensor-parallel jobs: the local executor with a replica of two local ranks, and the Ray executor with two
TP = 2 replicas, each a placement group of two rank actors. A rank killed mid-shard fails its replica's
attempt; the replica is rebuilt, the shard retried, every id committed exactly once, and the generations
are the single-rank job's."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from batch_support import (
    assert_finished_layout,
    faults_override,
    generations,
    local_ray,
    output_ids,
    overrides,
    sample_rows,
    tiny_model_dir,
    write_parquet,
)

from flashx_batch.config import compose_job
from flashx_batch.runner import run
from flashx_batch.runner.job import plan_job

pytestmark = pytest.mark.slow
N_ROWS = 14
SHARDING = ("runtime.shard_size=4", "runtime.max_batch_size=4", "sampling.max_new_tokens=12",
            "sampling.ignore_eos=true")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("in") / "in.parquet", sample_rows(N_ROWS, seed=11))


@pytest.fixture(scope="module")
def single_rank(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1") / "out"
    assert run(compose_job(overrides(tiny_model_dir(), data, out, "executor.kind=local", *SHARDING))) == 0
    return generations(out)


def _exactly_once(out):
    generated, errors = output_ids(out)
    assert not errors and max(generated.values()) == 1 and sorted(generated) == list(range(N_ROWS))
    assert_finished_layout(out)


def test_local_executor_runs_a_two_rank_replica(data, single_rank, tmp_path):
    out = tmp_path / "out"
    assert run(compose_job(overrides(tiny_model_dir(), data, out, "executor.kind=local",
                                     "runtime.tensor_parallel_size=2", *SHARDING))) == 0
    _exactly_once(out)
    assert generations(out) == single_rank


def test_ray_two_replicas_survive_a_rank_killed_mid_shard(data, single_rank, tmp_path):
    out = tmp_path / "out"
    args = (tiny_model_dir(), data, out, "executor.kind=ray", "executor.num_actors=2",
            "runtime.tensor_parallel_size=2", *SHARDING)
    plan = plan_job(compose_job(overrides(*args))).plan
    victim = plan.shards[0].shard_id
    # the victim shard's rank 1 is killed as rank 0 starts generating it (the ranks share a node)
    job = compose_job(overrides(*args, faults_override([f"kill_rank:shard={victim}:attempt=1"])))
    dispatched: list[tuple[str, int, str]] = []
    with local_ray(num_cpus=4):  # two replicas x two ranks x one CPU each
        assert run(job, on_dispatch=lambda spec, attempt, name: dispatched.append((spec.shard_id, attempt,
                                                                                   name))) == 0
    _exactly_once(out)
    assert generations(out) == single_rank  # the same tokens as one rank, the retried shard included
    killed = [(s, a, n) for s, a, n in dispatched if s == victim]
    assert [a for _, a, _ in killed] == [1, 2]  # the killed attempt, then its retry on a rebuilt replica
    assert killed[1][2] != killed[0][2]
    record = json.loads((out / "job.json").read_text())
    failures = [f for f in record["worker_failures"] if f["shard_id"] == victim]
    assert failures and failures[0]["kind"] == "fatal" and "ReplicaBroken" in failures[0]["type"]
    assert len({n for _, _, n in dispatched}) >= 2  # shards went to both replicas
    stats = pq.read_table(out / "stats").to_pylist()
    assert all(s["worker"].endswith("-rank0") for s in stats)  # rank 0 of a replica commits
    assert all(s["attempt"] == 1 for s in stats if s["shard_id"] != victim)
