"""Per-row sampling parameters (`sampling.from_columns`): one row's `SamplingParams`, or why not.

Who calls it: `data.plan` while planning (a bad value makes the row a `bad_sampling_param` error row
that never reaches an engine) and `runner.worker` to build the same parameters for the rows of its
shard. `sampling.from_columns` maps a sampling key to the input column holding its per-row value;
a null cell takes the job-wide `sampling.<key>`. The values are checked as the job-wide ones are
(`SamplingParams`, plus max_new_tokens <= runtime.max_output_len).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashx_batch.config_schema import SAMPLING_COLUMN_KEYS as COLUMN_KEYS
from flashx_batch.config_schema import SamplingSection
from flashx_batch.data.row_values import INT64, as_float, as_int, as_strings, describe
from flashx_batch.data.validate import RowProblem
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.params import SamplingParams

BAD_SAMPLING_PARAM = "bad_sampling_param"


def row_params(sampling: SamplingSection, columns: Mapping[str, list[Any]], row: int, seed: int,
               max_output_len: int) -> SamplingParams | RowProblem:
    """Row `row`'s parameters: the job-wide ones (`seed`: the row's own, derived from the job seed),
    each key of `sampling.from_columns` replaced by its column's non-null value."""
    values: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, stop=tuple(sampling.stop),
                                  ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs, n=sampling.n)
    where = "job-wide sampling settings"
    for key, column in sampling.from_columns.items():
        raw = columns[column][row]
        if raw is None:
            continue
        value = _parse(COLUMN_KEYS[key], raw)
        if value is None:
            return RowProblem(BAD_SAMPLING_PARAM, f"sampling.{key} from column {column!r} is {describe(raw)}; "
                                                  f"expected {_EXPECTED[COLUMN_KEYS[key]]}")
        values[key] = value
        where = f"column(s) {', '.join(map(repr, sampling.from_columns.values()))}"
    try:
        params = SamplingParams(**values)
    except ConfigError as exc:
        return RowProblem(BAD_SAMPLING_PARAM, f"{str(exc).rstrip('.')} (from {where})")
    if params.max_new_tokens > max_output_len:
        return RowProblem(BAD_SAMPLING_PARAM, f"sampling.max_new_tokens={params.max_new_tokens} exceeds "
                                              f"runtime.max_output_len={max_output_len} (from {where})")
    return params


_EXPECTED = {"int": "an integer in int64's range", "float": "a finite number", "seed": "an integer in [0, 2**63)",
             "stop": "a string or a list of strings", "bool": "true or false"}


def _parse(kind: str, raw: Any) -> Any:
    """A cell as the key's type (`data.row_values`), or None when it is not one."""
    if kind == "bool":
        return raw if isinstance(raw, bool) else None
    if kind == "stop":
        return as_strings(raw)
    if kind == "float":
        return as_float(raw)
    return as_int(raw, 0, INT64) if kind == "seed" else as_int(raw)
