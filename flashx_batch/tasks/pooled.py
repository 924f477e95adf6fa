"""Tasks whose rows are one prefill each, pooled at the end: `task=embed` (one vector per row,
`Engine.embed`) and `task=classify` (a sequence classifier's logits, probabilities and label per row,
`Engine.classify`); both over `runtime/pooling.py`.

The rows are planned as prompts are (checked, tokenized, bucketed by length; `data.prompt_prefix` is the
instruction an embedding model wants before each text, e.g. Qwen3-Embedding's "Instruct: ...\\nQuery: ").
Result rows: `id`, the task's values, `num_input_tokens`, `truncated`, `shard_id`, then the passthrough
columns. `embedding` is a fixed_size_list<float32>[D] (one Parquet dataset a vector store loads).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pyarrow as pa

from flashx_batch.config_schema import CONSTRAINT_KEYS
from flashx_batch.data.plan import Plan, ShardSpec, plan_prompts
from flashx_batch.data.validate import RowProblem, build_prompt
from flashx_batch.errors import ConfigError
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
        return plan_prompts(job, loaded, tokenizer)

    def read(self, source: ShardSource, spec: ShardSpec) -> ShardRows:
        data = source.job.data
        ids, texts, extra = [], [], {c: [] for c in data.passthrough_columns}
        for fi, ri, fr, k in source.shard_rows(spec):
            value = fr.columns[data.prompt_column][k]
            text = build_prompt(value, value, False, data.prompt_prefix, data.max_row_bytes, source.engine.tokenizer,
                                None, data.chat_template_kwargs)
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
        encoded = engine.tokenizer.encode_batch(rows.inputs)
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
        if e.pooling is not None and e.pooling not in ("last", "mean", "cls"):
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
