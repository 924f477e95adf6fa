"""task=generate: prompted rows (a prompt or chat messages) in, generated text out (`generations_table`),
optionally scored against a reference column (`eval.metric`)."""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa

from flashx_batch.data.plan import Plan, ShardSpec, adapter_name, adapter_problem, plan_prompts
from flashx_batch.data.preflight import prompt_roles
from flashx_batch.data.row_sampling import may_constrain, row_params
from flashx_batch.data.validate import RowProblem, build_prompt, row_tools
from flashx_batch.evaluation.metrics import score_row as metric_score
from flashx_batch.runtime.chat_output import MARKERS, OutputFormat, output_format
from flashx_batch.tasks.base import ShardResult, ShardRows, ShardSource, Task, passthrough_arrays, register
from flashx_batch.tasks.tables import (
    GENERATION_COLUMNS,
    chat_columns,
    generations_table,
    sample_columns,
    score_column,
)


def chat_format(job, tokenizer) -> OutputFormat:
    """What a chat job's answers hold besides text (reasoning, tool calls), from the model's templates;
    prompt (non-chat) jobs' text is written as generated."""
    if not job.data.messages_column or tokenizer is None:
        return OutputFormat()
    return output_format("\n".join(tokenizer.chat_templates.values()))


def _with_markers(tokenizer, ids: list[int], markers: set[str], stops: tuple[str, ...]) -> str:
    """A generation's text with the chat tags kept (the other special tokens skipped, as in generated_text)
    and cut at the first stop string, as generated_text is."""
    text = tokenizer.decode_keeping(ids, markers)
    cuts = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text


def row_seed(job_seed: int, row_id: Any) -> int:
    """A row's sampling seed: a stable hash of (job seed, row id), so sharding never changes samples."""
    digest = hashlib.sha256(f"{job_seed}\x1f{row_id!r}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@register
class Generate(Task):
    name = "generate"
    verb = "generated"
    generates = True

    def text_column(self, data) -> str:
        return data.messages_column or data.prompt_column

    def column_roles(self, data) -> dict[str, str]:
        return prompt_roles(data)

    def result_columns(self) -> tuple[str, ...]:
        return GENERATION_COLUMNS

    def plan(self, job, loaded, tokenizer) -> Plan:
        return plan_prompts(job, loaded, tokenizer)

    def read(self, source: ShardSource, spec: ShardSpec) -> ShardRows:
        """The shard's ids, prompt texts and sampling parameters, as planned (a row the plan accepted that
        fails now means the input changed since)."""
        job = source.job
        data, s = job.data, job.sampling
        text_col = self.text_column(data)
        ids, texts, params = [], [], []
        extra: dict[str, list[Any]] = {c: [] for c in data.passthrough_columns}
        # each output is scored against its row's reference (`eval.metric`; a null reference: unscored)
        references: list[Any] | None = [] if job.eval.metric else None
        tools: list[Any] = []  # per row: its tool definitions (they tell how a parsed call's values are typed)
        adapters: list[str | None] = []  # per row: its LoRA adapter (data.adapter_column; None: the base model)
        for fi, ri, fr, k in source.shard_rows(spec):
            value = fr.columns[text_col][k]
            row_tool_list = row_tools(data, fr.columns, k)
            text = build_prompt(value, value, bool(data.messages_column), data.prompt_prefix, data.max_row_bytes,
                                source.engine.tokenizer, row_tool_list, data.chat_template_kwargs)
            row_id = fr.columns[data.id_column][k]
            p = text if isinstance(text, RowProblem) else \
                row_params(s, fr.columns, k, row_seed(s.seed, row_id), job.runtime.max_output_len)
            if isinstance(p, RowProblem):
                raise RuntimeError(f"{source.files[fi].path} row {ri}: {p.message}; the input changed after "
                                   "planning")
            ids.append(row_id)
            texts.append(text)
            params.append(p)
            tools.append(row_tool_list if isinstance(row_tool_list, list) else None)
            adapter = fr.columns[data.adapter_column][k] if data.adapter_column else None
            if adapter is not None and (bad := adapter_problem(job, adapter)) is not None:
                raise RuntimeError(f"{source.files[fi].path} row {ri}: {bad.message}; the input changed after "
                                   "planning")
            adapters.append(adapter_name(adapter))
            for c in extra:
                extra[c].append(fr.columns[c][k])
            if references is not None:
                references.append(fr.columns[job.eval.reference_column][k])
        return ShardRows(ids, (texts, params, references, tools, adapters),
                         passthrough_arrays(extra, source.passthrough_types))

    def compute(self, source: ShardSource, rows: ShardRows, spec: ShardSpec) -> ShardResult:
        job, engine = source.job, source.engine
        texts, params, references, tools, adapters = rows.inputs
        job_tools = list(job.data.tools) if job.data.tools else None
        # chat rows are template-rendered text that already carries BOS / role tokens
        token_lists = engine.tokenizer.encode_batch(texts, add_special_tokens=not job.data.messages_column)
        # sampling.n > 1: n outputs per row, in row order
        outs = engine.generate(token_lists, params, adapters=adapters if job.data.adapter_column else None)
        g = engine.last_stats
        of_row = pa.array([o.index for o in outs], pa.int64())
        logprobs = bool(job.sampling.logprobs)
        samples = sample_columns([o.sample_index for o in outs] if job.sampling.n > 1 else None,
                                 [o.token_ids for o in outs] if logprobs else None,
                                 [o.logprobs for o in outs] if logprobs else None,
                                 [o.top_logprobs for o in outs] if logprobs else None)
        if may_constrain(job.sampling):  # null for a row without a constraint (a fitted JSON schema)
            samples["constraint_met"] = pa.array([o.constraint_met for o in outs], pa.bool_())
            samples["json_bound_reached"] = pa.array([o.json_bound_reached for o in outs], pa.bool_())
        answers = [o.text or "" for o in outs]
        fmt = chat_format(job, engine.tokenizer)
        if fmt.parses:  # chat rows: the answer without its reasoning and tool calls (runtime.chat_output)
            markers = engine.tokenizer.special_among(MARKERS)  # a template's tags some vocabularies mark special
            if markers:
                answers = [_with_markers(engine.tokenizer, o.token_ids, markers, params[o.index].stop) for o in outs]
            answers = chat_columns(fmt, answers, [tools[o.index] or job_tools for o in outs], samples)
        if references is not None:  # the answer is scored, not the reasoning
            samples.update(score_column([metric_score(job.eval.metric, a, references[o.index],
                                                      source.metric_pattern) for a, o in zip(answers, outs)]))
        table = generations_table([rows.ids[o.index] for o in outs], source.id_kind, answers,
                                  [o.finish_reason for o in outs], [o.num_input_tokens for o in outs],
                                  [o.num_generated_tokens for o in outs], spec.shard_id,
                                  {c: a.take(of_row) for c, a in rows.passthrough.items()}, samples)
        return ShardResult(table, g.input_tokens, g.output_tokens, {
            "padding_efficiency": g.padding_efficiency, "prefill_s": g.prefill_s, "decode_s": g.decode_s,
            "kv_bytes_peak": g.kv_bytes_peak,
            # the most rows decoding at once: more than max_batch_size under segment_sparse and batch growth
            "batch_size": max(engine.admitted_batch_size, g.peak_rows),
            "batches": g.batches, "kv_bytes_arena": g.kv_bytes_arena, "kv_bytes_static_peak": g.kv_bytes_static_peak,
            "cached_prompt_tokens": g.cached_prompt_tokens, "prefill_tokens_computed": g.prefill_tokens_computed,
            "prefix_hit_rate": g.cached_prompt_tokens / g.input_tokens if g.input_tokens else 0.0,
            # constraints this shard compiled (the actor's engine keeps them compiled for its later shards)
            "grammar_compiles": g.grammar_compiles,
        })
