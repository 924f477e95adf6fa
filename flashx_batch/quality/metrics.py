"""Teacher-forced comparison metrics for the quality harness. `Agreement` lives in
`flashx_batch.quant.agreement`, since the quantization planner (runtime core, which never imports
`quality`) measures with it too; it is re-exported here for `quality` code."""

from flashx_batch.quant.agreement import Agreement

__all__ = ["Agreement"]
