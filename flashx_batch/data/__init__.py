"""Input side of a batch job: readers, preflight checks, per-row validation, the shard plan.

`load_inputs` (preflight) → a task's `plan` (`plan_prompts` / `plan_scored`: validate, tokenize, bucket,
shard) → `format_plan`.
"""

from flashx_batch.data.plan import Plan, ShardSpec, format_plan, plan_prompts, plan_scored
from flashx_batch.data.preflight import LoadedInput, load_inputs

__all__ = ["LoadedInput", "Plan", "ShardSpec", "format_plan", "load_inputs", "plan_prompts", "plan_scored"]
