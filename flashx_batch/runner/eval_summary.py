"""The job-level evaluation result (`eval.metric`): every committed row's `score`, the error rows as
unscored, summarised as a mean with a bootstrap 95 % interval (`evaluation.metrics.summarise`), overall
and per length bucket (for the report's plot). Called by `runner.job` after the invariant check, so it
reads exactly the committed rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flashx_batch.config import JobConfig
from flashx_batch.evaluation.metrics import summarise

if TYPE_CHECKING:
    from flashx_batch.runner.outputs import Output


def evaluate(job: JobConfig, output: Output, totals: dict[str, Any], stats: Any,
             committed: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """{"overall": summary dict, "buckets": [{"bucket", **summary}]} for `job.eval.metric`, over the
    `committed` pieces (default: as they are now)."""
    committed = output.committed() if committed is None else committed
    scores: list[float | None] = []
    by_shard: dict[str, list[float | None]] = {}
    for pid, manifest in sorted(committed.items()):
        if "generations" not in manifest["files"]:
            continue
        table = output.read_part("generations", pid, ["shard_id", "score"], committed)
        for shard, score in zip(table.column("shard_id").to_pylist(), table.column("score").to_pylist(),
                                strict=True):
            scores.append(score)
            by_shard.setdefault(shard, []).append(score)
    errors = totals.get("error_rows", 0) * max(1, job.sampling.n)  # an error row stands for each of its samples
    e = job.eval
    overall = summarise(e.metric, scores + [None] * errors, e.resamples)
    buckets: dict[str, list[float | None]] = {}
    if stats is not None:
        for shard, lo, hi in zip(stats.column("shard_id").to_pylist(), stats.column("bucket_min_len").to_pylist(),
                                 stats.column("bucket_max_len").to_pylist(), strict=True):
            buckets.setdefault(f"{lo}-{hi}", []).extend(by_shard.get(shard, []))
    per_bucket = [{"bucket": b, **summarise(e.metric, s, e.resamples).as_dict()}
                  for b, s in sorted(buckets.items(), key=lambda kv: int(kv[0].split("-")[0]))]
    return {"overall": overall.as_dict(), "buckets": per_bucket, "describe": overall.describe()}
