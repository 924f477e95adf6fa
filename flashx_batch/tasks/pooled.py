"""Tasks whose rows are one prefill each, pooled at the end: `task=embed` (one vector per row,
`Engine.embed`), `task=classify` (a sequence classifier's logits, probabilities and label per row,
`Engine.classify`) and `task=score` (a one-label classifier's score of a (query, document) pair per row:
rerankers, reward models; `Engine.scores` on pairs written by `pooling.pair_text`, as `Engine.score_pairs`
writes them); all over `runtime/pooling.py`.

The rows are planned as prompts are (checked, tokenized, bucketed by length; `data.prompt_prefix` is the
instruction an embedding model wants before each text, e.g. Qwen3-Embedding's "Instruct: ...\\nQuery: ").
Result rows: `id`, the task's values, `num_input_tokens`, `truncated`, `shard_id`, then the passthrough
columns. `embedding` is a fixed_size_list<float32>[D] (one Parquet dataset a vector store loads).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pyarrow as pa

from flashx_batch.config_schema import CONSTRAINT_KEYS
from flashx_batch.data.plan import Plan, ShardSpec, plan_prompts
from flashx_batch.data.validate import BAD_TYPE, RowProblem, build_prompt, check_text
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.pooling import PAIR_FORMATS, POOLINGS, pair_text
from flashx_batch.tasks.base import ShardResult, ShardRows, ShardSource, Task, passthrough_arrays, register
from flashx_batch.tasks.tables import id_type


class Pooled(Task):
    values_columns: ClassVar[tuple[str, ...]]

    def validate(self, job) -> None:
        d, s = job.data, job.sampling
        if d.messages_column:
            raise ConfigError(f"data.messages_column is set but task={self.name} reads text; give it in "
                              "data.prompt_column (a chat template's rendering can be written there).")
        constrained = [f"sampling.{k}" for k in CONSTRAINT_KEYS if getattr(s, k) is not None]
        if s.n != 1 or s.logprobs or s.from_columns or constrained:
            raise ConfigError(f"sampling.n, sampling.logprobs, sampling.from_columns and constraints shape generated "
                              f"text, and task={self.name} generates none; drop them.")
        if job.eval.metric:
            raise ConfigError(f"eval.metric={job.eval.metric} scores text, and task={self.name} writes none; drop it.")
        if job.runtime.long_input not in ("error", "truncate"):
            raise ConfigError(f"task={self.name} takes runtime.long_input=error or truncate (a long prompt keeps its "
                              f"first max_input_len tokens), not {job.runtime.long_input}.")
        if job.runtime.backend == "onnx" or job.runtime.tensor_parallel_size > 1:
            raise ConfigError(f"task={self.name} reads every position's hidden states: it runs on a torch backend "
                              "(not runtime.backend=onnx) with runtime.tensor_parallel_size=1.")
        if job.output.format != "parquet" and not (self.name == "embed" and job.output.format == "openai_batch"):
            raise ConfigError(f"task={self.name} writes Parquet (output.format=parquet).")

    def text_column(self, data) -> str:
        return data.prompt_column

    def column_roles(self, data) -> dict[str, str]:
        return {data.prompt_column: "data.prompt_column"}

    def result_columns(self) -> tuple[str, ...]:
        return ("id", *self.values_columns, "num_input_tokens", "truncated", "shard_id")

    def plan(self, job, loaded, tokenizer) -> Plan:
        return plan_prompts(job, loaded, tokenizer, self.row_text(job, tokenizer), self.add_special_tokens(job))

    def row_text(self, job, tokenizer) -> Callable[[Mapping[str, list], int], str | RowProblem]:
        """A row's text, or its problem (what the plan checked and the worker reads)."""
        data = job.data

        def text(columns: Mapping[str, list], row: int) -> str | RowProblem:
            value = columns[data.prompt_column][row]
            return build_prompt(value, value, False, data.prompt_prefix, data.max_row_bytes, tokenizer, None,
                                data.chat_template_kwargs)
        return text

    def add_special_tokens(self, job) -> bool:
        return True

    def read(self, source: ShardSource, spec: ShardSpec) -> ShardRows:
        data = source.job.data
        ids, texts, extra = [], [], {c: [] for c in data.passthrough_columns}
        row_text = self.row_text(source.job, source.engine.tokenizer)
        for fi, ri, fr, k in source.shard_rows(spec):
            text = row_text(fr.columns, k)
            if isinstance(text, RowProblem):
                raise RuntimeError(f"{source.files[fi].path} row {ri}: {text.message}; the input changed after "
                                   "planning")
            ids.append(fr.columns[data.id_column][k])
            texts.append(text)
            for c in extra:
                extra[c].append(fr.columns[c][k])
        return ShardRows(ids, texts, passthrough_arrays(extra, source.passthrough_types))

    def compute(self, source: ShardSource, rows: ShardRows, spec: ShardSpec) -> ShardResult:
        job, engine = source.job, source.engine
        encoded = engine.tokenizer.encode_batch(rows.inputs, add_special_tokens=self.add_special_tokens(job))
        limit = job.runtime.max_input_len
        values, stats = self.values(job, engine, encoded)
        cols: dict[str, Any] = {
            "id": pa.array(rows.ids, id_type(source.id_kind)), **values,
            "num_input_tokens": pa.array([min(len(t), limit) for t in encoded], pa.int32()),
            "truncated": pa.array([len(t) > limit for t in encoded], pa.bool_()),
            "shard_id": pa.array([spec.shard_id] * len(rows.ids), pa.string()),
        }
        clash = set(cols) & set(rows.passthrough)
        if clash:  # preflight refuses these; never let one reach a committed file
            raise ValueError(f"passthrough column(s) {sorted(clash)} would overwrite output columns")
        tokens = sum(min(len(t), limit) for t in encoded)
        return ShardResult(pa.table({**cols, **rows.passthrough}), tokens, 0,
                           {"batch_size": engine.admitted_batch_size, "task": self.name, **stats})

    def values(self, job, engine, encoded: list[list[int]]) -> tuple[dict[str, pa.Array], dict[str, Any]]:
        raise NotImplementedError


@register
class Embed(Pooled):
    name = "embed"
    verb = "embedded"
    values_columns = ("embedding",)

    def validate(self, job) -> None:
        super().validate(job)
        e = job.embed
        if e.pooling is not None and e.pooling not in POOLINGS:
            raise ConfigError(f"embed.pooling={e.pooling!r}: one of last, mean, cls (or null: the model's own).")
        if e.dimensions is not None and e.dimensions < 1:
            raise ConfigError(f"embed.dimensions={e.dimensions}: give a positive count of components, or null.")

    def values(self, job, engine, encoded):
        vectors = engine.embed(encoded, job.embed.pooling, job.embed.normalize, job.embed.dimensions)
        width = vectors.shape[1]
        flat = pa.array(vectors.reshape(-1).numpy(), pa.float32())
        return {"embedding": pa.FixedSizeListArray.from_arrays(flat, width)}, {"embedding_dim": width}


@register
class Classify(Pooled):
    name = "classify"
    verb = "classified"
    values_columns = ("logits", "probs", "label")

    def values(self, job, engine, encoded):
        out = engine.classify(encoded)
        return {"logits": pa.array([c.logits for c in out], pa.list_(pa.float32())),
                "probs": pa.array([c.probs for c in out], pa.list_(pa.float32())),
                "label": pa.array([c.label for c in out], pa.string())}, {}


@register
class Score(Pooled):
    """(query, document) pairs scored by a cross-encoder: a one-label sequence classifier (a reranker, a reward
    model) reading the pair as `pooling.pair_text` writes it; `data.prompt_prefix` goes before the pair."""

    name = "score"
    verb = "scored"
    values_columns = ("score",)

    def validate(self, job) -> None:
        super().validate(job)
        d = job.data
        if job.score.format not in PAIR_FORMATS:
            raise ConfigError(f"score.format={job.score.format!r}: one of {', '.join(PAIR_FORMATS)}.")
        if job.score.format == "chat" and d.prompt_prefix:
            raise ConfigError("data.prompt_prefix with score.format=chat would stand before the template's own start "
                              "tokens; put the instruction in the query column (the user turn), or use "
                              "score.format=separator.")
        if d.query_column == d.document_column:
            raise ConfigError(f"data.query_column and data.document_column are both {d.query_column!r}; a pair "
                              "needs two columns.")

    def text_column(self, data) -> str:
        return data.query_column

    def column_roles(self, data) -> dict[str, str]:
        return {data.query_column: "data.query_column", data.document_column: "data.document_column"}

    def row_text(self, job, tokenizer):
        data, score = job.data, job.score

        def text(columns: Mapping[str, list], row: int) -> str | RowProblem:
            query = check_text(columns[data.query_column][row], f"query ({data.query_column})", data.max_row_bytes)
            if isinstance(query, RowProblem):
                return query
            document = check_text(columns[data.document_column][row], f"document ({data.document_column})",
                                  data.max_row_bytes)
            if isinstance(document, RowProblem):
                return document
            try:
                text = pair_text(query, document, score.format, score.separator, tokenizer, data.chat_template_kwargs)
            except ValueError as exc:  # the chat template's own refusal
                return RowProblem(BAD_TYPE, f"the chat template rejected the pair: {exc}")
            except Exception as exc:  # a template error on this row's data (jinja2 TemplateError, TypeError)
                return RowProblem(BAD_TYPE, f"the chat template failed on the pair: {type(exc).__name__}: {exc}")
            kept = document.strip()
            if score.format == "chat" and kept and (kept[:64] not in text or kept[-64:] not in text):
                return RowProblem("unrendered_message", "the chat template left the document (the assistant turn) "
                                                        "out of the text; score.format=separator reads it as given")
            return data.prompt_prefix + text
        return text

    def add_special_tokens(self, job) -> bool:
        return job.score.format != "chat"  # a chat template writes its own BOS

    def values(self, job, engine, encoded):
        return {"score": pa.array(engine.scores(encoded), pa.float32())}, {}
