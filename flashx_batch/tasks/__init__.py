"""What a job computes per row (`task=`): the `Task` protocol and its registry (`tasks.base`), one module
per task family, and the output tables they write (`tasks.tables`)."""

from flashx_batch.tasks import generate, pooled, scoring  # noqa: F401 - registers the tasks
from flashx_batch.tasks.base import ShardResult, ShardRows, Task, get_task, read_columns, register

__all__ = ["ShardResult", "ShardRows", "Task", "get_task", "read_columns", "register"]
