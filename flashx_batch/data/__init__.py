"""Input side of a batch job: readers, preflight checks, per-row validation, the shard plan.

`load_inputs` (preflight) → `build_plan` (validate, tokenize, bucket, shard) → `format_plan`.
"""

from flashx_batch.data.plan import Plan, ShardSpec, build_plan, format_plan
from flashx_batch.data.preflight import LoadedInput, load_inputs

__all__ = ["LoadedInput", "Plan", "ShardSpec", "build_plan", "format_plan", "load_inputs"]
