"""The shard plan: validate and tokenize every row, bucket by token length, cut shards.

Who calls it: `runner.job.run` (driver) once per run, before the output directory is touched;
`dry_run` prints `format_plan(plan)` and stops there. The plan is a pure function of the input,
the tokenizer and the plan knobs (all in the fingerprint), so shard ids are stable across runs —
that is what lets a resumed run skip exactly the shards that committed.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashx_batch.config_schema import DataSection, JobConfig
from flashx_batch.data import openai_batch
from flashx_batch.data.preflight import LoadedInput
from flashx_batch.data.readers import Frame, InputFile
from flashx_batch.data.refs import ROW_BITS, IdColumn, PackedRefs, Ref, RefIds
from flashx_batch.data.row_sampling import row_params
from flashx_batch.data.validate import (
    PROMPT_TOO_LONG,
    RowProblem,
    build_prompt,
    encode_score_rows,
    row_tools,
    score_row,
)
from flashx_batch.kvcache.prefix_cache import block_keys
from flashx_batch.runtime.grammar import compile_check
from flashx_batch.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_ENCODE_CHUNK = 1024
_SIGNATURE_BLOCKS = 64  # prefix blocks remembered per row for grouping (8 bytes each)


@dataclass(frozen=True)
class ShardSpec:
    """One unit of work and commit. `refs` point into the input files; no row data travels with it."""

    shard_id: str
    kind: str  # "generate" | "invalid" (rows rejected while planning; the driver commits those)
    bucket: int
    bucket_min_len: int
    bucket_max_len: int
    refs: PackedRefs  # a tuple of refs is packed on construction
    input_tokens: int
    est_padding_efficiency: float

    def __post_init__(self) -> None:
        if not isinstance(self.refs, PackedRefs):
            object.__setattr__(self, "refs", PackedRefs(self.refs))

    @property
    def num_rows(self) -> int:
        return len(self.refs)


@dataclass(frozen=True)
class RowError:
    ref: Ref
    id: Any
    code: str
    message: str
    stage: str  # "validate" | "tokenize"


@dataclass
class BucketSummary:
    index: int
    min_len: int
    max_len: int
    rows: int = 0
    shards: int = 0
    input_tokens: int = 0
    est_padding_efficiency: float = 1.0


@dataclass
class Plan:
    files: list[InputFile]
    id_kind: str
    ids: IdColumn  # every input id, in input order (the invariant's right-hand side)
    shards: list[ShardSpec]  # generate shards, in dispatch order (longest bucket first)
    error_shards: list[ShardSpec]
    row_errors: dict[str, list[RowError]]  # error-shard id -> its rows
    buckets: list[BucketSummary]
    error_counts: Counter = field(default_factory=Counter)
    ref_ids: Mapping = field(default_factory=dict)  # ref -> id of every planned row (`RefIds`)
    padding_bucketed: float = 1.0
    padding_unbucketed: float = 1.0
    shared_token_fraction: float = 0.0  # prefix reuse: prompt tokens in blocks another row of the shard shares

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def num_valid(self) -> int:
        return sum(s.num_rows for s in self.shards)

    def summary(self) -> dict[str, Any]:
        """The plan as job.json records it (no refs: those are recomputed from the input)."""
        return {
            "rows": self.num_rows, "valid_rows": self.num_valid, "error_rows": sum(self.error_counts.values()),
            "expected_shared_token_fraction": self.shared_token_fraction,
            "error_counts": dict(self.error_counts), "shards": len(self.shards), "error_shards": len(self.error_shards),
            "padding_efficiency_bucketed": self.padding_bucketed,
            "padding_efficiency_unbucketed": self.padding_unbucketed,
            "buckets": [vars(b) for b in self.buckets],
            "shard_ids": [s.shard_id for s in self.shards + self.error_shards],
        }


def bucket_edges(job: JobConfig) -> list[int]:
    """Upper bounds of the length buckets; default powers of two from 16 up to max_input_len."""
    limit = job.runtime.max_input_len
    edges = sorted({e for e in job.runtime.bucket_edges if e < limit}) if job.runtime.bucket_edges else [
        2**k for k in range(4, 32) if 2**k < limit]
    return [*edges, limit]


class _Rows:
    """The valid rows of a plan, columnar: global row index, prompt tokens, and (prefix reuse only)
    each row's prefix signature."""

    def __init__(self, signatures: bool) -> None:
        self.index, self.length = array("q"), array("q")
        self.signatures: list[tuple] | None = [] if signatures else None

    def add(self, g: int, length: int, signature: tuple = ()) -> None:
        self.index.append(g)
        self.length.append(length)
        if self.signatures is not None:
            self.signatures.append(signature)


@dataclass
class _Scan:
    """What one streaming pass over the input leaves: every id, the valid rows, the error rows, and
    the global index where each file's rows start."""

    ids: IdColumn
    rows: _Rows
    errors: list[RowError]
    starts: list[int]


def _chunks(loaded: LoadedInput, data: DataSection, scan: _Scan) -> Iterator[tuple[int, int, int, Frame, int]]:
    """(file index, first row index, global index of that row, frame, rows of it to plan), in input
    order, up to `data.limit` rows; every id goes into `scan.ids` as its chunk is handed out."""
    remaining = data.limit if data.limit is not None else float("inf")
    for fi, offset, fr in loaded.chunks():
        while len(scan.starts) <= fi:
            scan.starts.append(len(scan.ids))
        if remaining <= 0:  # data.limit reached
            break
        n = int(min(fr.num_rows, remaining))
        if n == 0:  # an empty file (or chunk): the files after it still count
            continue
        g = len(scan.ids)
        for v in fr.columns[data.id_column][:n]:
            scan.ids.append(v)
        remaining -= n
        yield fi, offset, g, fr, n
    while len(scan.starts) < len(loaded.files):
        scan.starts.append(len(scan.ids))


def plan_prompts(job: JobConfig, loaded: LoadedInput, tokenizer: Tokenizer,
                 row_text: Callable[[Mapping[str, list], int], str | RowProblem] | None = None,
                 add_special_tokens: bool | None = None) -> Plan:
    """The plan of prompted rows (task=generate, and the pooled tasks): validate, tokenize, bucket and shard
    every row of `loaded`, streaming it a chunk at a time. `row_text(columns, row)`: a task's own text of a
    row (a scored pair), instead of its prompt or messages; `add_special_tokens`: whether that text is
    encoded with the tokenizer's BOS (default: unless the rows are chat-rendered)."""
    data = job.data
    if add_special_tokens is None:
        add_special_tokens = not data.messages_column
    text_col = data.messages_column or data.prompt_column
    segment = job.runtime.segment_size if job.runtime.prefix_cache_tokens else 0
    limit, truncate = job.runtime.max_input_len, job.runtime.long_input != "error"
    scan = _Scan(IdColumn(loaded.id_kind), _Rows(signatures=bool(segment)), [], [])
    openai = data.format == "openai_batch"  # a request line's own problems come first (data.openai_batch)
    constraint_problem = compile_check(tokenizer)  # per-row constraints: the grammar library's compile check
    for fi, offset, g0, fr, n in _chunks(loaded, data, scan):
        pending: list[tuple[int, str]] = []  # (row index in the chunk, prompt text)
        for i in range(n):
            ri, row_id = offset + i, fr.columns[data.id_column][i]
            if row_text is not None:
                text = row_text(fr.columns, i)
            else:
                value = fr.columns[text_col][i]
                text = build_prompt(value, value, bool(data.messages_column), data.prompt_prefix, data.max_row_bytes,
                                    tokenizer, row_tools(data, fr.columns, i), data.chat_template_kwargs)
            if openai and isinstance(bad_request := openai_batch.row_problem(job, fr.columns, i), RowProblem):
                scan.errors.append(RowError((fi, ri), row_id, bad_request.code, bad_request.message, "validate"))
            elif isinstance(text, RowProblem):
                scan.errors.append(RowError((fi, ri), row_id, text.code, text.message, "validate"))
            elif data.adapter_column and isinstance(bad := adapter_problem(job, fr.columns[data.adapter_column][i]),
                                                    RowProblem):
                scan.errors.append(RowError((fi, ri), row_id, bad.code, bad.message, "validate"))
            elif job.sampling.from_columns and isinstance(
                    bad := row_params(job.sampling, fr.columns, i, 0, job.runtime.max_output_len,
                                      constraint_problem), RowProblem):
                scan.errors.append(RowError((fi, ri), row_id, bad.code, bad.message, "validate"))
            else:
                pending.append((i, text))
        lengths, signatures = _token_lengths([t for _, t in pending], tokenizer, segment,
                                             add_special_tokens=add_special_tokens)
        for (i, _), count, signature in zip(pending, lengths, signatures, strict=True):
            ref, row_id = (fi, offset + i), fr.columns[data.id_column][i]
            if count > limit and not truncate:
                scan.errors.append(RowError(ref, row_id, PROMPT_TOO_LONG,
                                            f"prompt has {count} tokens, more than runtime.max_input_len={limit} "
                                            "(runtime.long_input=error)", "tokenize"))
            elif count == 0:
                scan.errors.append(RowError(ref, row_id, "empty_prompt", "prompt has no tokens", "tokenize"))
            else:
                scan.rows.add(g0 + i, min(count, limit), signature)
    return _assemble(job, loaded, scan)


UNKNOWN_ADAPTER = "unknown_adapter"


def adapter_name(value: Any) -> Any:
    """A data.adapter_column cell as a name, None for the base model: null, or an empty string (a CSV cannot
    write null)."""
    return None if value is None or value == "" else value


def adapter_problem(job: JobConfig, value: Any) -> RowProblem | None:
    """A row's data.adapter_column cell: null or empty (the base model) or a name in model.lora_adapters."""
    value = adapter_name(value)
    if value is None or (isinstance(value, str) and value in job.model.lora_adapters):
        return None
    names = ", ".join(sorted(job.model.lora_adapters))
    return RowProblem(UNKNOWN_ADAPTER, f"data.adapter_column={job.data.adapter_column} is {value!r}, not an adapter "
                                       f"of model.lora_adapters ({names}) or null (the base model)")


def plan_scored(job: JobConfig, loaded: LoadedInput, tokenizer: Tokenizer) -> Plan:
    """The plan of a scoring task (loglikelihood, multiple_choice, perplexity): rows checked and encoded by
    the rules the engine scores them with, bucketed by the tokens the model reads per row."""
    from flashx_batch.runtime.lm_requests import LMEncoder

    data = job.data
    encoder = LMEncoder.for_tokenizer(tokenizer)
    scan = _Scan(IdColumn(loaded.id_kind), _Rows(signatures=False), [], [])
    for fi, offset, g0, fr, n in _chunks(loaded, data, scan):
        pending: list[tuple[int, Any]] = []
        for i in range(n):
            row = score_row(job.task, data, fr.columns, i)
            if isinstance(row, RowProblem):
                scan.errors.append(RowError((fi, offset + i), fr.columns[data.id_column][i], row.code, row.message,
                                            "validate"))
            else:
                pending.append((i, row))
        for start in range(0, len(pending), _ENCODE_CHUNK):
            chunk = pending[start : start + _ENCODE_CHUNK]
            encoded = encode_score_rows(job.task, [r for _, r in chunk], encoder, job.runtime.max_input_len,
                                        data.target_delimiter, job.runtime.long_input)
            for (i, _), enc in zip(chunk, encoded, strict=True):
                if isinstance(enc, RowProblem):
                    scan.errors.append(RowError((fi, offset + i), fr.columns[data.id_column][i], enc.code,
                                                enc.message, "tokenize"))
                else:
                    scan.rows.add(g0 + i, enc.length)
    return _assemble(job, loaded, scan)


def _token_lengths(texts: list[str], tokenizer: Tokenizer, segment: int,
                   add_special_tokens: bool = True) -> tuple[list[int], list[tuple]]:
    """Token counts, and (when prefix reuse is on, `segment` > 0) each row's prefix signature: the
    chain keys of its first `_SIGNATURE_BLOCKS` segment-sized blocks, as the engine's cache keys them."""
    lengths: list[int] = []
    signatures: list[tuple] = []
    for start in range(0, len(texts), _ENCODE_CHUNK):
        for ids in tokenizer.encode_batch(texts[start : start + _ENCODE_CHUNK], add_special_tokens=add_special_tokens):
            lengths.append(len(ids))
            limit = min(len(ids) - 1, segment * _SIGNATURE_BLOCKS)
            signatures.append(tuple(k[:8] for k in block_keys(ids, segment, limit)) if segment else ())
    return lengths, signatures


def _assemble(job: JobConfig, loaded: LoadedInput, scan: _Scan) -> Plan:
    edges = bucket_edges(job)
    batch, shard_size = job.runtime.max_batch_size, job.runtime.shard_size
    rows, ids, starts = scan.rows, scan.ids, np.asarray(scan.starts, dtype=np.int64)
    index = np.frombuffer(rows.index, dtype=np.int64) if len(rows.index) else np.zeros(0, np.int64)
    length = np.frombuffer(rows.length, dtype=np.int64) if len(rows.length) else np.zeros(0, np.int64)
    bucket = np.minimum(np.searchsorted(np.asarray(edges), length, side="left"), len(edges) - 1)
    # longest buckets first (the slow shards start early); in a bucket longest first, then input order;
    # with prefix reuse, rows sharing a prefix first, so they land in one shard and one batch (a cache
    # hit is planned, not left to chance)
    if rows.signatures is None:
        order = np.lexsort((index, -length, -bucket))
    else:
        sigs = rows.signatures
        order = np.array(sorted(range(len(index)), key=lambda k: (-bucket[k], sigs[k], -length[k], index[k])),
                         dtype=np.int64)
    files = np.searchsorted(starts, index, side="right") - 1
    codes = (files << ROW_BITS) | (index - starts[files])
    shards, buckets = [], []
    useful = computed = 0
    shared = 0
    sorted_bucket = bucket[order]
    for b in sorted(set(sorted_bucket.tolist()), reverse=True):
        members = order[sorted_bucket == b]
        lens = length[members]
        summary = BucketSummary(b, edges[b - 1] + 1 if b else 1, edges[b], rows=len(members),
                                input_tokens=int(lens.sum()),
                                est_padding_efficiency=padding_efficiency(lens.tolist(), batch, presorted=True))
        for seq, start in enumerate(range(0, len(members), shard_size)):
            chunk = members[start : start + shard_size]
            chunk_lens = length[chunk].tolist()
            member_ids = [ids[int(g)] for g in index[chunk]]
            shards.append(ShardSpec(_shard_id(f"b{b:02d}", seq, member_ids), "generate", b, summary.min_len,
                                    summary.max_len, PackedRefs(array("q", codes[chunk].tobytes())),
                                    sum(chunk_lens), padding_efficiency(chunk_lens, batch, presorted=True)))
            useful += sum(chunk_lens)
            computed += _padded_slots(sorted(chunk_lens, reverse=True), batch)
            if rows.signatures is not None:
                counts = Counter(key for k in chunk for key in rows.signatures[k])
                shared += sum(job.runtime.segment_size * sum(1 for key in rows.signatures[k] if counts[key] > 1)
                              for k in chunk)
            summary.shards += 1
        buckets.append(summary)
    error_shards, row_errors = [], {}
    errors = sorted(scan.errors, key=lambda e: e.ref)
    for seq, start in enumerate(range(0, len(errors), shard_size)):
        chunk = errors[start : start + shard_size]
        spec = ShardSpec(_shard_id("err", seq, [e.id for e in chunk]), "invalid", -1, 0, 0,
                         PackedRefs(e.ref for e in chunk), 0, 1.0)
        error_shards.append(spec)
        row_errors[spec.shard_id] = chunk
    in_order = length.tolist()  # rows were added in input order
    plan = Plan(loaded.files, loaded.id_kind, ids, shards, error_shards, row_errors, buckets,
                Counter(e.code for e in errors), RefIds(ids, scan.starts),
                padding_bucketed=useful / computed if computed else 1.0,
                padding_unbucketed=padding_efficiency(in_order, batch, presorted=False),
                shared_token_fraction=shared / useful if useful and rows.signatures is not None else 0.0)
    log.info("plan: %d rows, %d valid in %d shards, %d error rows; padding efficiency %.3f bucketed vs %.3f not",
             plan.num_rows, len(index), len(shards), len(errors), plan.padding_bucketed, plan.padding_unbucketed)
    return plan


def padding_efficiency(lengths: list[int], batch: int, presorted: bool) -> float:
    """Prompt tokens / prefill slots when `lengths` run in static batches of `batch` rows.

    presorted=False keeps the given order (a naive static batcher); True sorts longest first, as the
    engine does inside a shard. Decode steps are left out: they depend on when rows stop.
    """
    lens = sorted(lengths, reverse=True) if presorted else list(lengths)
    slots = _padded_slots(lens, batch)
    return sum(lens) / slots if slots else 1.0


def _padded_slots(lens: list[int], batch: int) -> int:
    return sum(len(lens[i : i + batch]) * max(lens[i : i + batch]) for i in range(0, len(lens), batch))


def _bucket_of(n: int, edges: list[int]) -> int:
    for i, edge in enumerate(edges):
        if n <= edge:
            return i
    return len(edges) - 1


def _shard_id(prefix: str, seq: int, ids: list[Any]) -> str:
    # The digest ties the name to its members: a plan that drifted (it cannot, while the fingerprint
    # matches) would produce new names instead of silently reusing committed ones.
    digest = hashlib.sha1("\x1f".join(map(repr, ids)).encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{prefix}-{seq:04d}-{digest}"


def format_plan(plan: Plan) -> str:
    """The plan as a plain-text table (the CLI prints it for dry_run and at the start of a run)."""
    lines = [f"{'bucket':>12} {'rows':>7} {'shards':>6} {'in_tokens':>10} {'pad_eff':>7}"]
    for b in sorted(plan.buckets, key=lambda b: b.index):
        lines.append(f"{f'{b.min_len}-{b.max_len}':>12} {b.rows:>7} {b.shards:>6} {b.input_tokens:>10} "
                     f"{b.est_padding_efficiency:>7.3f}")
    lines.append(f"{'total':>12} {plan.num_valid:>7} {len(plan.shards):>6} "
                 f"{sum(b.input_tokens for b in plan.buckets):>10}")
    lines.append("")
    lines.append(f"input rows: {plan.num_rows} in {len(plan.files)} file(s); valid: {plan.num_valid}; "
                 f"error rows: {sum(plan.error_counts.values())}"
                 + (f" ({', '.join(f'{k}={v}' for k, v in sorted(plan.error_counts.items()))})"
                    if plan.error_counts else ""))
    lines.append(f"padding efficiency (prefill, estimated): with bucketing {plan.padding_bucketed:.3f}, "
                 f"without bucketing {plan.padding_unbucketed:.3f}")
    if plan.shared_token_fraction:
        lines.append(f"prefix reuse: {plan.shared_token_fraction:.1%} of prompt tokens in blocks shared within a shard")
    return "\n".join(lines)
