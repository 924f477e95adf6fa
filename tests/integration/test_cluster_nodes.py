"""Failure domains and the elastic pool on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`,
three 1-CPU worker nodes on this machine): a node that fails every attempt is excluded and every shard
commits on the others; a node added mid-job receives an actor and work; a node removed mid-job loses
nothing. Every run: each id exactly once."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import ray
from batch_support import (
    REPO,
    assert_finished_layout,
    faults_override,
    output_ids,
    overrides,
    sample_rows,
    tiny_model_dir,
    write_parquet,
)

from flashx_batch.config import compose_job
from flashx_batch.runner import run

pytestmark = pytest.mark.slow
N_ROWS = 36


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [c.add_node(num_cpus=1) for _ in range(3)]
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("in") / "in.parquet", sample_rows(N_ROWS, seed=13))


def _job(data, out, *extra):
    return compose_job(overrides(tiny_model_dir(), data, out, "executor.kind=ray", "runtime.shard_size=2",
                                 "runtime.max_batch_size=2", "runtime.max_output_len=48", "sampling.max_new_tokens=24",
                                 "sampling.ignore_eos=true",
                                 *extra))


def _nodes_record(out):
    generated, errors = output_ids(out)
    assert not errors and max(generated.values()) == 1 and sorted(generated) == list(range(N_ROWS))
    assert_finished_layout(out)
    record = json.loads((out / "job.json").read_text())
    assert record["status"] == "succeeded"
    return record["nodes"]


def test_a_node_failing_every_attempt_is_excluded(cluster, data, tmp_path):
    _, workers = cluster
    bad = workers[0].node_id
    out = tmp_path / "out"
    # every attempt there fails as a disk that is full (an `error`: the actor stays, and keeps failing)
    assert run(_job(data, out, faults_override([f"enospc:node={bad}"]))) == 0
    nodes = _nodes_record(out)
    assert nodes[bad]["excluded"] and "3 different shards failed in a row" in nodes[bad]["excluded"]
    assert nodes[bad]["shards"] == 0 and nodes[bad]["failed_attempts"] == 3
    good = [w.node_id for w in workers[1:]]
    committed = pq.read_table(out / "stats").num_rows  # one stats row per committed shard
    assert sum(nodes[n]["shards"] for n in good) == committed and all(nodes[n]["excluded"] is None for n in good)


def test_a_node_added_mid_job_gets_an_actor_and_work(cluster, data, tmp_path):
    c, workers = cluster
    added: list = []

    def add_after_first_shards(spec, attempt, name):
        if not added and len(dispatched) == 1:
            added.append(c.add_node(num_cpus=1))
        dispatched.append(spec.shard_id)

    dispatched: list[str] = []
    out = tmp_path / "out"
    # the first nodes take two seconds more per shard: work is left when the new node's actor has loaded (and
    # warmed) its engine
    slow = faults_override([f"delay:node={w.node_id}:seconds=2" for w in workers])
    assert run(_job(data, out, slow), on_dispatch=add_after_first_shards) == 0
    nodes = _nodes_record(out)
    new = added[0].node_id
    assert nodes[new]["actors_placed"] >= 1 and nodes[new]["shards"] >= 1
    workers.append(added[0])


def test_a_node_removed_mid_job_loses_nothing(cluster, data, tmp_path):
    c, workers = cluster
    victim = workers[1]
    removed: list = []

    def remove_mid_job(spec, attempt, name):
        if not removed and len(dispatched) == 5:
            c.remove_node(victim)
            removed.append(victim.node_id)
        dispatched.append(spec.shard_id)

    dispatched: list[str] = []
    out = tmp_path / "out"
    assert run(_job(data, out, faults_override(["delay:seconds=0.5"])), on_dispatch=remove_mid_job) == 0
    nodes = _nodes_record(out)
    assert removed and nodes[removed[0]]["alive"] is False
    assert sum(n["shards"] for n in nodes.values()) == pq.read_table(out / "stats").num_rows
