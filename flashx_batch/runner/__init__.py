"""Job execution: `run(JobConfig) -> exit code` and the pieces it drives.

job.py (orchestration) → executor.py (local) / ray_executor.py (Ray pool) → worker.py (one engine,
one shard at a time) → layout.py (commit protocol). fingerprint.py decides resume vs refuse;
signals.py and progress.py handle the terminal.
"""

from flashx_batch.runner.job import run

__all__ = ["run"]
