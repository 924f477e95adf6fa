"""Arrow tables of the output layout (README "Output"): result rows (generations, or a scoring task's),
errors and stats, one builder each.

Who calls it: the tasks (their result rows), `runner.worker` (stats, per shard), `runner.job` and
`runner.failures` (error rows). Keeping the column lists here keeps every writer on the same schema.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from flashx_batch.runtime.chat_output import parse

GENERATION_COLUMNS = ("id", "generated_text", "finish_reason", "num_input_tokens", "num_generated_tokens", "shard_id")
# written only when asked for: sample_index (sampling.n > 1, right after id), the token columns (sampling.logprobs)
SAMPLE_COLUMNS = ("sample_index", "token_ids", "token_logprobs", "top_logprobs")
# what a generation's text holds, parsed: its constraint met (constrained jobs), and for chat rows of a model
# whose template has them, the reasoning and the tool calls split from the answer
STRUCTURED_COLUMNS = ("constraint_met", "json_bound_reached", "reasoning_content", "tool_calls", "tool_call_error")
TOP_LOGPROB = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
ERROR_COLUMNS = ("id", "error_code", "error_message", "stage")
STATS_COLUMNS = ("shard_id", "bucket_min_len", "bucket_max_len", "rows", "rows_failed", "input_tokens",
                 "output_tokens", "padding_efficiency", "prefill_s", "decode_s", "wall_s", "output_tok_per_s",
                 "total_tok_per_s", "kv_bytes_peak", "cache_policy", "batch_size", "device", "attempt")
# The result rows of the scoring tasks (`task`), written to generations/ like a generate job's rows.
SCORE_COLUMNS = {
    "loglikelihood": ("id", "logprob", "num_tokens", "is_greedy", "truncated", "shard_id"),
    "multiple_choice": ("id", "choice_logprobs", "choice_logprobs_norm", "pred", "pred_norm", "correct", "truncated",
                        "shard_id"),
    "perplexity": ("id", "logprob", "num_tokens", "perplexity", "shard_id"),
}
_SCORE_TYPES = {"logprob": pa.float64(), "num_tokens": pa.int32(), "is_greedy": pa.bool_(),
                "choice_logprobs": pa.list_(pa.float64()), "choice_logprobs_norm": pa.list_(pa.float64()),
                "pred": pa.int32(), "pred_norm": pa.int32(), "correct": pa.bool_(), "perplexity": pa.float64(),
                "truncated": pa.bool_()}
# written with `eval.metric`: each row's score against its reference (null: the row could not be scored)
EVAL_COLUMNS = ("score",)
# Columns we write into the row tables: no user-supplied column may take one of these names
# (`data.passthrough_columns` is checked against it before the output directory is touched).
RESERVED_COLUMNS = tuple(dict.fromkeys(GENERATION_COLUMNS + ERROR_COLUMNS + SAMPLE_COLUMNS + STRUCTURED_COLUMNS
                                      + EVAL_COLUMNS))


def score_column(scores: list[float | None]) -> dict[str, pa.Array]:
    """The `score` column (double; null where a row could not be scored)."""
    return {"score": pa.array(scores, pa.float64())}


def reserved_column_problem(passthrough: list[str], result_columns: tuple[str, ...] = ()) -> str | None:
    """Why `data.passthrough_columns` cannot be written as given, or None: a name we write ourselves
    (it would replace the real value in every row), or a name listed twice. `result_columns`: the job's
    task's (`Task.result_columns`), reserved as well."""
    written = RESERVED_COLUMNS + tuple(result_columns)
    clash = [c for c in passthrough if c in written]
    if clash:
        return (f"data.passthrough_columns lists {', '.join(map(repr, clash))}, a column name flashx-batch writes "
                f"itself (reserved: {', '.join(dict.fromkeys(written))}); a passthrough copy would replace the real "
                "value. Rename the input column, or drop it from data.passthrough_columns (the row id is always "
                "written as `id`).")
    twice = sorted({c for c in passthrough if passthrough.count(c) > 1})
    if twice:
        return f"data.passthrough_columns lists {', '.join(map(repr, twice))} more than once; list each column once."
    return None


def id_type(id_kind: str) -> pa.DataType:
    return pa.int64() if id_kind == "int" else pa.string()


def generations_table(ids: list[Any], id_kind: str, texts: list[str], finish: list[str], n_in: list[int],
                      n_out: list[int], shard_id: str, passthrough: dict[str, pa.Array],
                      samples: dict[str, pa.Array] | None = None) -> pa.Table:
    """`samples`: the SAMPLE_COLUMNS a job asked for (`sample_columns`)."""
    samples = samples or {}
    cols = {
        "id": pa.array(ids, id_type(id_kind)),
        **({"sample_index": samples["sample_index"]} if "sample_index" in samples else {}),
        "generated_text": pa.array(texts, pa.string()),
        "finish_reason": pa.array(finish, pa.string()),
        "num_input_tokens": pa.array(n_in, pa.int32()),
        "num_generated_tokens": pa.array(n_out, pa.int32()),
        "shard_id": pa.array([shard_id] * len(ids), pa.string()),
        **{k: v for k, v in samples.items() if k != "sample_index"},
    }
    clash = set(cols) & set(passthrough)
    if clash:  # preflight refuses these; never let one reach a committed file
        raise ValueError(f"passthrough column(s) {sorted(clash)} would overwrite output columns")
    cols.update(passthrough)
    return pa.table(cols)


def sample_columns(sample_index: list[int] | None, token_ids: list[list[int]] | None,
                   logprobs: list[list[float]] | None, top: list[list[list[tuple[int, float]]]] | None
                   ) -> dict[str, pa.Array]:
    """The optional generation columns: `sample_index` int32 (None: n = 1, not written); with logprobs,
    `token_ids` list<int64>, `token_logprobs` list<double> (one per generated token) and `top_logprobs`
    list<list<struct<token_id: int64, logprob: double>>> (per token, the top K, most likely first)."""
    out: dict[str, pa.Array] = {}
    if sample_index is not None:
        out["sample_index"] = pa.array(sample_index, pa.int32())
    if logprobs is not None:
        out["token_ids"] = pa.array(token_ids, pa.list_(pa.int64()))
        out["token_logprobs"] = pa.array(logprobs, pa.list_(pa.float64()))
        out["top_logprobs"] = pa.array([[[{"token_id": t, "logprob": v} for t, v in step] for step in row]
                                        for row in top], pa.list_(pa.list_(TOP_LOGPROB)))
    return out


TOOL_CALL = pa.struct([("id", pa.string()), ("type", pa.string()),
                       ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])


def chat_columns(fmt: Any, texts: list[str], tools: list[Any], out: dict[str, pa.Array]) -> list[str]:
    """Chat answers parsed by `fmt` (`runtime.chat_output`): `reasoning_content` (string, null without a
    thinking block) where the model's template writes reasoning, `tool_calls` (OpenAI's list of calls, null
    without one) and `tool_call_error` (why a call stayed in the text) where it writes tool calls, added
    to `out`; returns the answers left."""
    parsed = [parse(t, fmt, tl) for t, tl in zip(texts, tools)]
    if fmt.reasoning:
        out["reasoning_content"] = pa.array([p.reasoning for p in parsed], pa.string())
    if fmt.tool_calls is not None:
        out["tool_calls"] = pa.array([p.tool_calls for p in parsed], pa.list_(TOOL_CALL))
        out["tool_call_error"] = pa.array([p.tool_call_error for p in parsed], pa.string())
    return [p.content for p in parsed]


def score_table(task: str, ids: list[Any], id_kind: str, values: dict[str, list[Any]], shard_id: str,
                passthrough: dict[str, pa.Array]) -> pa.Table:
    """The result rows of a scoring task: SCORE_COLUMNS[task] (`values` holds all but id and shard_id)."""
    cols = {"id": pa.array(ids, id_type(id_kind))}
    for name in SCORE_COLUMNS[task][1:-1]:
        cols[name] = pa.array(values[name], _SCORE_TYPES[name])
    cols["shard_id"] = pa.array([shard_id] * len(ids), pa.string())
    clash = set(cols) & set(passthrough)
    if clash:  # preflight refuses these; never let one reach a committed file
        raise ValueError(f"passthrough column(s) {sorted(clash)} would overwrite output columns")
    cols.update(passthrough)
    return pa.table(cols)


def errors_table(ids: list[Any], id_kind: str, codes: list[str], messages: list[str], stages: list[str]) -> pa.Table:
    return pa.table({
        "id": pa.array(ids, id_type(id_kind)),
        "error_code": pa.array(codes, pa.string()),
        "error_message": pa.array(messages, pa.string()),
        "stage": pa.array(stages, pa.string()),
    })


def stats_table(row: dict[str, Any]) -> pa.Table:
    """One stats row; columns beyond STATS_COLUMNS (host, worker, ...) are kept after them."""
    missing = [c for c in STATS_COLUMNS if c not in row]
    if missing:
        raise ValueError(f"stats row lacks {missing}")
    ordered = {c: [row[c]] for c in STATS_COLUMNS}
    ordered.update({k: [v] for k, v in row.items() if k not in ordered})
    return pa.table(ordered)
