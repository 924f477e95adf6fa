"""Live metrics on Ray's Prometheus endpoint: scraped while a job runs, the counters move; once it ends
they equal job.json's accounting (rows, error rows, output tokens)."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request

import pyarrow.parquet as pq
import pytest
import ray
from batch_support import REPO, faults_override, overrides, sample_rows, tiny_model_dir, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.runner import run

pytestmark = pytest.mark.slow
N_ROWS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    """flashx metric name -> the sum of its series (this job's only) on the endpoint, {} if not up yet."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^ray_(flashx_[a-z_]+?)(?:_total)?\{.*\} ([0-9.e+-]+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def test_counters_move_during_the_run_and_end_at_the_accounting(tmp_path):
    rows = sample_rows(N_ROWS, seed=9)
    rows[5]["prompt"] = None  # a plan-time error row, committed by the driver
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    port = _free_port()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 200})
    seen: list[dict[str, float]] = []
    done = threading.Event()

    def scraper():
        while not done.is_set():
            seen.append(_scrape(port))
            time.sleep(0.2)

    thread = threading.Thread(target=scraper, daemon=True)
    try:
        from ray.util.metrics import Gauge

        Gauge("flashx_probe", description="the endpoint is up").set(1)
        deadline = time.monotonic() + 60
        while "flashx_probe" not in _scrape(port) and time.monotonic() < deadline:  # the agent is exporting
            time.sleep(0.2)
        thread.start()
        # one actor, one row at a time, long generations: several seconds of commits to scrape
        job = compose_job(overrides(tiny_model_dir(), data, out, "executor.kind=ray", "executor.num_actors=1",
                                    "runtime.shard_size=2", "runtime.max_batch_size=1", "runtime.batch_growth=1",
                                    "runtime.max_output_len=96", "sampling.max_new_tokens=96",
                                    "sampling.ignore_eos=true", faults_override(["delay:seconds=0.3"])))
        assert run(job) == 0
        record = json.loads((out / "job.json").read_text())
        acc = record["accounting"]
        tokens = sum(pq.read_table(out / "generations").column("num_generated_tokens").to_pylist())
        want = {"flashx_rows_committed": acc["generated_rows"], "flashx_error_rows": acc["error_rows"],
                "flashx_output_tokens": tokens}
        deadline = time.monotonic() + 30
        final = {}
        while time.monotonic() < deadline:
            final = _scrape(port)
            if all(final.get(k) == v for k, v in want.items()):
                break
            time.sleep(0.3)
        assert {k: final.get(k) for k in want} == want
        assert final.get("flashx_shards_committed", 0) >= N_ROWS // 2 - 1 and final.get("flashx_shard_latency_s_count")
    finally:
        done.set()
        thread.join(5)
        ray.shutdown()
    progress = sorted({s.get("flashx_rows_committed", 0.0) for s in seen if s})
    assert len([v for v in progress if 0 < v < acc["generated_rows"]]) >= 2  # scraped mid-run, moving up
