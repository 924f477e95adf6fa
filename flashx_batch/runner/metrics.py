"""Live job metrics through Ray's own metrics API (`ray.util.metrics`): they appear on every node's
Prometheus endpoint (`ray start --metrics-export-port=...`, scraped as `ray_flashx_*`) and on Ray's
dashboard while the job runs, tagged with the job's output directory.

Recorded by the driver, which sees every commit: rows committed (generated), error rows (plan-time ones
the driver commits, and rows given up at run time), output tokens, shards committed, failed attempts
(by kind), shard latency (dispatch to commit) and the output tokens/s of this run. A fresh run's final
counters equal job.json's accounting; a resumed run counts what it commits itself.

Without Ray (`executor.kind=local`) there is no metrics agent to report to: every call is a no-op and
the per-shard stats in Parquet and report.md remain the record.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)
# dispatch-to-commit seconds: from tiny test shards to shards of long generations on slow devices
LATENCY_BOUNDARIES = [0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800]


class JobMetrics:
    def __init__(self, job_name: str | None) -> None:
        """`job_name`: the `job` tag; None: a recorder that records nothing (a progress bar without a job)."""
        ray = sys.modules.get("ray")  # never import Ray just for metrics: a local job has none
        self.enabled = job_name is not None and ray is not None and ray.is_initialized()
        if not self.enabled:
            return
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = ("job",)
        self.rows = Counter("flashx_rows_committed", description="Generated rows committed", tag_keys=tags)
        self.error_rows = Counter("flashx_error_rows", description="Error rows committed", tag_keys=tags)
        self.tokens = Counter("flashx_output_tokens", description="Output tokens committed", tag_keys=tags)
        self.shards = Counter("flashx_shards_committed", description="Shards (or pieces) committed", tag_keys=tags)
        self.failures = Counter("flashx_failed_attempts", description="Failed shard attempts, by kind",
                                tag_keys=("job", "kind"))
        self.rate = Gauge("flashx_output_tokens_per_s", description="Output tokens/s of this run so far",
                          tag_keys=tags)
        self.latency = Histogram("flashx_shard_latency_s", description="Shard dispatch to commit, seconds",
                                 boundaries=LATENCY_BOUNDARIES, tag_keys=tags)
        for metric in (self.rows, self.error_rows, self.tokens, self.shards, self.rate, self.latency):
            metric.set_default_tags({"job": job_name})
        self.job_name = job_name

    def committed(self, summary: dict[str, Any], latency_s: float | None = None) -> None:
        """A worker's shard summary, once its commit won (`committed`)."""
        if not self.enabled or not summary.get("committed", True):
            return
        self._inc(self.rows, summary.get("rows", 0))
        self._inc(self.error_rows, summary.get("rows_failed", 0))
        self._inc(self.tokens, summary.get("output_tokens", 0))
        self.shards.inc(1)
        if latency_s is not None:
            self.latency.observe(latency_s)

    def error_rows_committed(self, count: int) -> None:
        """Error rows the driver committed (plan-time problems, rows given up at run time)."""
        if self.enabled:
            self._inc(self.error_rows, count)

    def failed(self, kind: str) -> None:
        if self.enabled:
            self.failures.inc(1, tags={"job": self.job_name, "kind": kind})

    def tokens_per_s(self, value: float) -> None:
        if self.enabled:
            self.rate.set(value)

    @staticmethod
    def _inc(counter: Any, value: float) -> None:
        if value > 0:  # Ray's counters refuse 0
            counter.inc(value)
