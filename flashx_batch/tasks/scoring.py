"""The scoring tasks: rows scored by the model's log-likelihoods, no text generated (lm-eval's request
types). `loglikelihood`: a continuation given a context; `multiple_choice`: each choice given the context
(its natural metric: accuracy against `data.answer_column`); `perplexity`: a whole text, rolling."""

from __future__ import annotations

import math
from typing import Any

from flashx_batch.config_schema import CONSTRAINT_KEYS
from flashx_batch.data.plan import Plan, ShardSpec, plan_scored
from flashx_batch.data.validate import RowProblem, encode_score_rows, score_row
from flashx_batch.errors import ConfigError
from flashx_batch.tasks.base import ShardResult, ShardRows, ShardSource, Task, passthrough_arrays, register
from flashx_batch.tasks.tables import SCORE_COLUMNS, score_column, score_table


class Scoring(Task):
    """What the scoring tasks share: their checks, plan, rows and stats; `values` is each one's own."""

    def validate(self, job) -> None:
        d, s = job.data, job.sampling
        if d.messages_column:
            raise ConfigError(f"data.messages_column is set but task={self.name}; chat rows are for task=generate. "
                              "Give the rendered text in the context (or prompt) column.")
        if s.n != 1 or s.logprobs or s.from_columns:
            raise ConfigError(f"sampling.n, sampling.logprobs and sampling.from_columns shape generated text, and "
                              f"task={self.name} generates none; drop them (or use task=generate).")
        constrained = [f"sampling.{k}" for k in CONSTRAINT_KEYS if getattr(s, k) is not None]
        if constrained:
            raise ConfigError(f"{', '.join(constrained)} constrains generated text, and task={self.name} scores "
                              "given text without generating any; drop it (or use task=generate).")
        read = [column for _, column in self.named_columns(d)]
        clash = [c for c in read if c == d.id_column] or [c for c in read if read.count(c) > 1]
        if clash:
            raise ConfigError(f"task={self.name}: column {clash[0]!r} is named for two roles (id, context, "
                              "continuation, choices, answer); name a different column for each.")

    def text_column(self, data) -> str:
        return data.context_column

    def named_columns(self, data) -> list[tuple[str, str]]:
        """(setting, column) for each column this task reads, in order, repeats kept (`validate` refuses them)."""
        raise NotImplementedError

    def column_roles(self, data) -> dict[str, str]:
        roles: dict[str, str] = {}
        for key, column in self.named_columns(data):
            roles.setdefault(column, key)
        return roles

    def result_columns(self) -> tuple[str, ...]:
        return SCORE_COLUMNS[self.name]

    def plan(self, job, loaded, tokenizer) -> Plan:
        return plan_scored(job, loaded, tokenizer)

    def read(self, source: ShardSource, spec: ShardSpec) -> ShardRows:
        """The shard's rows checked and encoded as the plan did (a row that fails now: the input or the
        tokenizer changed since)."""
        job, lm = source.job, source.engine.lm
        ids, rows, extra = [], [], {c: [] for c in job.data.passthrough_columns}
        for fi, ri, fr, k in source.shard_rows(spec):
            row = score_row(self.name, job.data, fr.columns, k)
            if isinstance(row, RowProblem):
                raise RuntimeError(f"{source.files[fi].path} row {ri}: {row.message}; the input changed after "
                                   "planning")
            ids.append(fr.columns[job.data.id_column][k])
            rows.append(row)
            for c in extra:
                extra[c].append(fr.columns[c][k])
        encoded = encode_score_rows(self.name, rows, lm.encoder, lm.max_length, job.data.target_delimiter,
                                    job.runtime.long_input)
        bad = next((e for e in encoded if isinstance(e, RowProblem)), None)
        if bad is not None:
            raise RuntimeError(f"shard {spec.shard_id}: {bad.message}; the input or tokenizer changed after planning")
        return ShardRows(ids, (rows, encoded), passthrough_arrays(extra, source.passthrough_types))

    def compute(self, source: ShardSource, rows: ShardRows, spec: ShardSpec) -> ShardResult:
        lm = source.engine.lm
        checked, encoded = rows.inputs
        values = self.values(lm, checked, encoded)
        passthrough = rows.passthrough
        if source.job.eval.metric == "choice_accuracy":
            passthrough = {**score_column([None if c is None else float(c) for c in values["correct"]]),
                           **passthrough}
        table = score_table(self.name, rows.ids, source.id_kind, values, spec.shard_id, passthrough)
        # prefill_s: the runner's wall time (scoring is all prefill)
        return ShardResult(table, sum(e.length for e in encoded), 0, {"batch_size": lm.max_rows, "task": self.name})

    def values(self, lm: Any, rows: list, encoded: list) -> dict[str, list[Any]]:
        raise NotImplementedError


@register
class Loglikelihood(Scoring):
    name = "loglikelihood"

    def named_columns(self, data) -> list[tuple[str, str]]:
        return [("data.context_column", data.context_column), ("data.continuation_column", data.continuation_column)]

    def values(self, lm, rows, encoded):
        logprobs, greedy = lm.score_pairs([e.pairs[0] for e in encoded])
        return {"logprob": logprobs, "num_tokens": [len(e.pairs[0][1]) for e in encoded], "is_greedy": greedy,
                "truncated": [e.truncated for e in encoded]}


@register
class MultipleChoice(Scoring):
    name = "multiple_choice"

    def named_columns(self, data) -> list[tuple[str, str]]:
        answer = [("data.answer_column", data.answer_column)] if data.answer_column else []
        return [("data.context_column", data.context_column), ("data.choices_column", data.choices_column), *answer]

    def natural_metric(self, job) -> str | None:
        """Accuracy against the answer column, when the job has one (null answers are unscored rows)."""
        return "choice_accuracy" if job.data.answer_column else None

    def values(self, lm, rows, encoded):
        raw = [lps for lps, _ in lm.score_choices([list(e.pairs) for e in encoded])]
        norm = [[lp / len(c) for lp, c in zip(lps, r.choices, strict=True)] for lps, r in zip(raw, rows, strict=True)]
        pred = [_first_max(v) for v in raw]
        return {"choice_logprobs": raw, "choice_logprobs_norm": norm, "pred": pred,
                "pred_norm": [_first_max(v) for v in norm],
                "correct": [None if r.answer is None else p == r.answer for p, r in zip(pred, rows, strict=True)],
                "truncated": [e.truncated for e in encoded]}


@register
class Perplexity(Scoring):
    name = "perplexity"

    def validate(self, job) -> None:
        super().validate(job)
        if job.data.prompt_prefix:
            raise ConfigError("data.prompt_prefix is set but task=perplexity; a prefix would be scored as part of "
                              "every text. Remove it.")

    def text_column(self, data) -> str:
        return data.prompt_column

    def named_columns(self, data) -> list[tuple[str, str]]:
        return [("data.prompt_column", data.prompt_column)]

    def values(self, lm, rows, encoded):
        logprobs = lm.score_rolling([list(e.tokens) for e in encoded])
        counts = [len(e.tokens) for e in encoded]
        return {"logprob": logprobs, "num_tokens": counts,
                "perplexity": [math.exp(-lp / n) if -lp / n < 700 else math.inf
                               for lp, n in zip(logprobs, counts, strict=True)]}


def _first_max(values: list[float]) -> int:
    """Index of the largest value, the first on ties (numpy's argmax, as lm-eval picks)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))
