"""The Ray executor: same greedy generations as the local one; a killed actor loses no shard."""

from __future__ import annotations

import threading
import time

import pyarrow.parquet as pq
import pytest
import ray
from batch_support import generations, local_ray, output_ids, overrides, sample_rows, tiny_model_dir, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.runner import run


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(num_cpus=2):
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = sample_rows(16, seed=5)
    rows[3]["prompt"] = "  "
    return write_parquet(tmp_path_factory.mktemp("in") / "in.parquet", rows)


def test_ray_and_local_give_identical_greedy_generations(ray_cluster, data, tmp_path):
    local, remote = tmp_path / "local", tmp_path / "ray"
    assert run(compose_job(overrides(tiny_model_dir(), data, local, "executor.kind=local"))) == 0
    assert run(compose_job(overrides(tiny_model_dir(), data, remote, "executor.kind=ray",
                                     "executor.num_actors=2"))) == 0
    a, b = generations(local), generations(remote)
    assert len(a) == 15 and a == b
    workers = set(pq.read_table(remote / "stats").column("worker").to_pylist())
    assert len(workers) == 2 and "local" not in workers  # the shards really were spread over two actors


def test_actor_killed_mid_shard_is_retried(ray_cluster, data, tmp_path):
    out = tmp_path / "out"
    victim: dict[str, str] = {}

    def kill_first(spec, attempt, actor_name):
        if victim:
            return
        victim.update(shard=spec.shard_id, actor=actor_name)

        def killer():
            # wait until the actor has started this shard (its attempt directory exists), then kill it
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not list((out / "_attempts").glob(f"{spec.shard_id}.1.*")):
                time.sleep(0.002)
            ray.kill(ray.get_actor(actor_name))

        threading.Thread(target=killer, daemon=True).start()

    job = compose_job(overrides(tiny_model_dir(), data, out, "executor.kind=ray", "executor.num_actors=2",
                                "runtime.shard_size=4", "sampling.max_new_tokens=16", "sampling.ignore_eos=true"))
    assert run(job, on_dispatch=kill_first) == 0
    generated, errors = output_ids(out)
    assert max((generated + errors).values()) == 1 and sorted(generated + errors) == list(range(16))
    stats = pq.read_table(out / "stats").to_pylist()
    retried = [s for s in stats if s["shard_id"] == victim["shard"]]
    assert len(retried) == 1 and retried[0]["attempt"] == 2 and retried[0]["worker"] != victim["actor"]
    assert all(s["attempt"] == 1 for s in stats if s["shard_id"] != victim["shard"])
