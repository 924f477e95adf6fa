"""The task protocol: what a job computes per row (`task=`), one class per task, one registry.

A task names the columns it reads (with the setting that names each), checks its own settings, plans
its rows (checked, tokenized, bucketed into shards), reads a shard's rows and computes them into its
result table, and says how it is reported (its verb, its natural metric, whether it writes text). The
job layer does the rest once for every task: faults, timing, stats, commit, retries, accounting
(`runner.worker.ShardWorker.run_shard`, `runner.job`).

Adding a task: a module in this package with a `Task` subclass decorated `@register`, imported by
`tasks/__init__.py`; its result columns are reserved from passthrough names automatically
(`tables.reserved_column_problem`). docs/architecture.md, "Tasks", walks through one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import pyarrow as pa

from flashx_batch.errors import ConfigError

if TYPE_CHECKING:
    from flashx_batch.config_schema import DataSection, JobConfig
    from flashx_batch.data.plan import Plan, ShardSpec
    from flashx_batch.data.preflight import LoadedInput
    from flashx_batch.data.readers import Frame, InputFile
    from flashx_batch.runtime.tokenizer import Tokenizer


class ShardSource(Protocol):
    """What a task reads a shard through: the worker that runs it (`runner.worker.ShardWorker`)."""

    job: JobConfig
    engine: Any
    metric_pattern: Any

    @property
    def files(self) -> list[InputFile]: ...
    @property
    def id_kind(self) -> str: ...
    @property
    def passthrough_types(self) -> dict[str, pa.DataType]: ...
    def shard_rows(self, spec: ShardSpec) -> list[tuple[int, int, Frame, int]]: ...


@dataclass
class ShardRows:
    """A shard's rows as its task read them: the ids in row order, the task's own per-row inputs, and
    the passthrough columns."""

    ids: list[Any]
    inputs: Any
    passthrough: dict[str, pa.Array] = field(default_factory=dict)


@dataclass
class ShardResult:
    """A computed shard: its result rows (written to generations/), the tokens read and written, and the
    task's own stats columns (they override the job layer's defaults: `prefill_s`, `batch_size`, ...)."""

    table: pa.Table
    input_tokens: int
    output_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


class Task:
    name: ClassVar[str]
    verb: ClassVar[str] = "scored"  # the log's and report's word for a computed row
    generates: ClassVar[bool] = False  # writes text: tok/s in progress lines and report.md

    def validate(self, job: JobConfig) -> None:
        """This task's own checks of the settings (ConfigError naming the key)."""

    def text_column(self, data: DataSection) -> str:
        """The column a row's main text is in."""
        raise NotImplementedError

    def column_roles(self, data: DataSection) -> dict[str, str]:
        """The columns this task reads besides the id, each with the setting that names it."""
        raise NotImplementedError

    def result_columns(self) -> tuple[str, ...]:
        """The columns of its result rows that are always written."""
        raise NotImplementedError

    def natural_metric(self, job: JobConfig) -> str | None:
        """The metric a job of this task reports when `eval.metric` is unset (None: none)."""
        return None

    def plan(self, job: JobConfig, loaded: LoadedInput, tokenizer: Tokenizer) -> Plan:
        raise NotImplementedError

    def read(self, source: ShardSource, spec: ShardSpec) -> ShardRows:
        raise NotImplementedError

    def compute(self, source: ShardSource, rows: ShardRows, spec: ShardSpec) -> ShardResult:
        raise NotImplementedError


_REGISTRY: dict[str, Task] = {}


def register(cls: type[Task]) -> type[Task]:
    """Class decorator: make `cls` the task named `cls.name`."""
    _REGISTRY[cls.name] = cls()
    return cls


def get_task(name: str) -> Task:
    """The task named `name` (ConfigError listing the known ones otherwise)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"task={name!r} is not one of {', '.join(_REGISTRY)}.") from None


def read_columns(job: JobConfig) -> dict[str, str]:
    """Every column a job reads, each with the setting that names it: the id, the task's own, the
    passthrough columns, then the per-row sampling and eval columns."""
    from flashx_batch.data.preflight import column_roles

    return column_roles(job.data, get_task(job.task).column_roles(job.data), job.extra_columns())


def passthrough_arrays(values: Mapping[str, list[Any]], types: Mapping[str, pa.DataType]) -> dict[str, pa.Array]:
    """The passthrough columns as Arrow arrays of the types the preflight saw."""
    return {c: pa.array(v, types.get(c)) for c, v in values.items()}
