"""Per-row sampling parameters (`sampling.from_columns`): one row's `SamplingParams`, or why not.

Who calls it: `data.plan` while planning (a bad value makes the row a `bad_sampling_param` error row
that never reaches an engine) and `runner.worker` to build the same parameters for the rows of its
shard. `sampling.from_columns` maps a sampling key to the input column holding its per-row value;
a null cell takes the job-wide `sampling.<key>`. The values are checked as the job-wide ones are
(`SamplingParams`, plus max_new_tokens <= runtime.max_output_len); a row's constraint also by the grammar
library (`runtime.grammar`, through the planner's `constraint_problem`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flashx_batch.config_schema import CONSTRAINT_KEYS, SamplingSection
from flashx_batch.config_schema import SAMPLING_COLUMN_KEYS as COLUMN_KEYS
from flashx_batch.data.row_values import INT64, as_float, as_int, as_strings, describe
from flashx_batch.data.validate import RowProblem
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.constraints import Constraint, constraint_of
from flashx_batch.runtime.params import SamplingParams

BAD_SAMPLING_PARAM = "bad_sampling_param"
BAD_CONSTRAINT = "bad_constraint"


def row_params(sampling: SamplingSection, columns: Mapping[str, list[Any]], row: int, seed: int,
               max_output_len: int, constraint_problem: Callable[[Constraint], str | None] | None = None
               ) -> SamplingParams | RowProblem:
    """Row `row`'s parameters: the job-wide ones (`seed`: the row's own, derived from the job seed),
    each key of `sampling.from_columns` replaced by its column's non-null value. A row's own constraint
    (a json_schema / regex / choice / grammar column) replaces the job-wide one; one that is not valid, or
    that `constraint_problem` (the grammar library's compile check) refuses, is a `bad_constraint` row."""
    values: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, stop=tuple(sampling.stop),
                                  ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs, n=sampling.n,
                                  json_fit_budget=sampling.json_fit_budget)
    constraint = {key: getattr(sampling, key) for key in CONSTRAINT_KEYS}
    where = "job-wide sampling settings"
    own, constraint_from = False, ""  # the row's constraint comes from a column (these)
    for key, column in sampling.from_columns.items():
        raw = columns[column][row]
        if raw is None:
            continue
        value = _parse(COLUMN_KEYS[key], raw)
        if value is None:
            code = BAD_CONSTRAINT if key in CONSTRAINT_KEYS else BAD_SAMPLING_PARAM
            return RowProblem(code, f"sampling.{key} from column {column!r} is {describe(raw)}; "
                                    f"expected {_EXPECTED[COLUMN_KEYS[key]]}")
        if key in CONSTRAINT_KEYS:  # the row's own constraint replaces the job's, whatever its kind
            constraint = {k: None for k in CONSTRAINT_KEYS} if not own else constraint
            constraint[key], own = value, True
            given = [repr(sampling.from_columns[k]) for k in CONSTRAINT_KEYS if constraint[k] is not None]
            constraint_from = f"column(s) {', '.join(given)}"
        else:
            values[key] = value
        where = f"column(s) {', '.join(map(repr, sampling.from_columns.values()))}"
    constraint_from = constraint_from if own else "job-wide sampling settings"
    try:
        constraint_of(**constraint, where="sampling")
    except ConfigError as exc:
        return RowProblem(BAD_CONSTRAINT, f"{str(exc).rstrip('.')} (from {constraint_from})")
    try:
        params = SamplingParams(**values, **{k: v for k, v in constraint.items() if v is not None})
    except ConfigError as exc:
        return RowProblem(BAD_SAMPLING_PARAM, f"{str(exc).rstrip('.')} (from {where})")
    made = params.constraint  # what the engine compiles (a schema fitted to the row's budget)
    if made is not None and constraint_problem is not None and (problem := constraint_problem(made)) is not None:
        return RowProblem(BAD_CONSTRAINT, f"{params.describe_constraint()} cannot be compiled: {problem} "
                                          f"(from {constraint_from})")
    if params.max_new_tokens > max_output_len:
        return RowProblem(BAD_SAMPLING_PARAM, f"sampling.max_new_tokens={params.max_new_tokens} exceeds "
                                              f"runtime.max_output_len={max_output_len} (from {where})")
    return params


def job_constraint(sampling: SamplingSection) -> Constraint | None:
    """The job-wide constraint (`sampling.json_schema` / `regex` / `choice` / `grammar`) as the engine
    compiles it, or None; a malformed one is a ConfigError (exit 2)."""
    given = {key: getattr(sampling, key) for key in CONSTRAINT_KEYS}
    if constraint_of(**given, where="sampling") is None:
        return None
    return SamplingParams(max_new_tokens=sampling.max_new_tokens, json_fit_budget=sampling.json_fit_budget,
                          **{k: v for k, v in given.items() if v is not None}).constraint


def may_constrain(sampling: SamplingSection) -> bool:
    """Some row of the job may carry a constraint (job-wide, or a constraint column): its generations
    then have a `constraint_met` column."""
    return any(getattr(sampling, key) is not None or key in sampling.from_columns for key in CONSTRAINT_KEYS)


def _without_nulls(value: Any) -> Any:
    """A struct cell's schema without its null fields: a struct column holds every field any row of the file
    has, null where a row lacks it (a schema's own `"const": null` needs the schema as JSON text)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nulls(v) for v in value] if isinstance(value, list) else value


_EXPECTED = {"int": "an integer in int64's range", "float": "a finite number", "seed": "an integer in [0, 2**63)",
             "stop": "a string or a list of strings", "bool": "true or false",
             "json_schema": "a JSON schema object, or its JSON text", "text": "a non-empty string",
             "choice": "a list of strings, or its JSON text"}


def _parse(kind: str, raw: Any) -> Any:
    """A cell as the key's type (`data.row_values`), or None when it is not one."""
    if kind == "json_schema":  # JSON text, or a struct cell (a dict; its JSON text is checked by `constraint_of`)
        return raw if isinstance(raw, str) else _without_nulls(raw) if isinstance(raw, dict) else None
    if kind == "text":
        return raw if isinstance(raw, str) and raw else None
    if kind == "choice":
        return raw if isinstance(raw, str) else as_strings(raw) if isinstance(raw, list | tuple) else None
    if kind == "bool":
        return raw if isinstance(raw, bool) else None
    if kind == "stop":
        return as_strings(raw)
    if kind == "float":
        return as_float(raw)
    return as_int(raw, 0, INT64) if kind == "seed" else as_int(raw)
