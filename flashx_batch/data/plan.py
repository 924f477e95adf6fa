"""The shard plan: validate and tokenize every row, bucket by token length, cut shards.

Who calls it: `runner.job.run` (driver) once per run, before the output directory is touched;
`dry_run` prints `format_plan(plan)` and stops there. The plan is a pure function of the input,
the tokenizer and the plan knobs (all in the fingerprint), so shard ids are stable across runs —
that is what lets a resumed run skip exactly the shards that committed.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from flashx_batch.config import DataSection, JobConfig
from flashx_batch.data.preflight import LoadedInput
from flashx_batch.data.readers import InputFile
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
from flashx_batch.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_ENCODE_CHUNK = 1024
_SIGNATURE_BLOCKS = 64  # prefix blocks remembered per row for grouping (8 bytes each)

Ref = tuple[int, int]  # (file index, row index)


@dataclass(frozen=True)
class ShardSpec:
    """One unit of work and commit. `refs` point into the input files; no row data travels with it."""

    shard_id: str
    kind: str  # "generate" | "invalid" (rows rejected while planning; the driver commits those)
    bucket: int
    bucket_min_len: int
    bucket_max_len: int
    refs: tuple[Ref, ...]
    input_tokens: int
    est_padding_efficiency: float

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
    ids: list[Any]  # every input id, in input order (the invariant's right-hand side)
    shards: list[ShardSpec]  # generate shards, in dispatch order (longest bucket first)
    error_shards: list[ShardSpec]
    row_errors: dict[str, list[RowError]]  # error-shard id -> its rows
    buckets: list[BucketSummary]
    error_counts: Counter = field(default_factory=Counter)
    ref_ids: dict[Ref, Any] = field(default_factory=dict)  # every planned row's id (error rows written by the driver)
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


def _input_rows(loaded: LoadedInput, data: DataSection) -> Iterator[tuple[int, int, Any, Any]]:
    """(file index, row index, frame, row id) of every input row, in order, up to `data.limit` rows."""
    remaining = data.limit if data.limit is not None else float("inf")
    for fi, fr in enumerate(loaded.frames):
        for ri in range(fr.num_rows):
            if remaining <= 0:
                return
            remaining -= 1
            yield fi, ri, fr, fr.columns[data.id_column][ri]


def build_plan(job: JobConfig, loaded: LoadedInput, tokenizer: Tokenizer) -> Plan:
    """Validate, tokenize, bucket and shard every row of `loaded`."""
    if job.task != "generate":
        return _build_score_plan(job, loaded, tokenizer)
    data = job.data
    text_col = data.messages_column or data.prompt_column
    ids: list[Any] = []
    errors: list[RowError] = []
    pending: list[tuple[Ref, Any, str]] = []
    for fi, ri, fr, row_id in _input_rows(loaded, data):
        ids.append(row_id)
        value = fr.columns[text_col][ri]
        text = build_prompt(value, value, bool(data.messages_column), data.prompt_prefix, data.max_row_bytes,
                            tokenizer, row_tools(data, fr.columns, ri), data.chat_template_kwargs)
        if isinstance(text, RowProblem):
            errors.append(RowError((fi, ri), row_id, text.code, text.message, "validate"))
        elif job.sampling.from_columns and isinstance(
                bad := row_params(job.sampling, fr.columns, ri, 0, job.runtime.max_output_len), RowProblem):
            errors.append(RowError((fi, ri), row_id, bad.code, bad.message, "validate"))
        else:
            pending.append(((fi, ri), row_id, text))
    segment = job.runtime.segment_size if job.runtime.prefix_cache_tokens else 0
    lengths, signatures = _token_lengths([t for _, _, t in pending], tokenizer, segment,
                                         add_special_tokens=not data.messages_column)
    limit, truncate = job.runtime.max_input_len, job.runtime.long_input != "error"
    valid: list[tuple[Ref, Any, int]] = []
    for (ref, row_id, _), n, signature in zip(pending, lengths, signatures, strict=True):
        if n > limit and not truncate:
            errors.append(RowError(ref, row_id, PROMPT_TOO_LONG,
                                   f"prompt has {n} tokens, more than runtime.max_input_len={limit} "
                                   "(runtime.long_input=error)", "tokenize"))
        elif n == 0:
            errors.append(RowError(ref, row_id, "empty_prompt", "prompt has no tokens", "tokenize"))
        else:
            valid.append((ref, row_id, min(n, limit), signature))
    return _assemble(job, loaded, ids, valid, errors)


def _build_score_plan(job: JobConfig, loaded: LoadedInput, tokenizer: Tokenizer) -> Plan:
    """The plan of a scoring task (loglikelihood, multiple_choice, perplexity): rows checked and encoded by
    the rules the engine scores them with, bucketed by the tokens the model reads per row."""
    from flashx_batch.runtime.lm_requests import LMEncoder

    data = job.data
    ids: list[Any] = []
    errors: list[RowError] = []
    pending: list[tuple[Ref, Any, Any]] = []
    for fi, ri, fr, row_id in _input_rows(loaded, data):
        ids.append(row_id)
        row = score_row(job.task, data, fr.columns, ri)
        if isinstance(row, RowProblem):
            errors.append(RowError((fi, ri), row_id, row.code, row.message, "validate"))
        else:
            pending.append(((fi, ri), row_id, row))
    encoder = LMEncoder.for_tokenizer(tokenizer)
    valid: list[tuple[Ref, Any, int, tuple]] = []
    for start in range(0, len(pending), _ENCODE_CHUNK):
        chunk = pending[start : start + _ENCODE_CHUNK]
        encoded = encode_score_rows(job.task, [r for _, _, r in chunk], encoder, job.runtime.max_input_len,
                                    data.target_delimiter)
        for (ref, row_id, _), enc in zip(chunk, encoded, strict=True):
            if isinstance(enc, RowProblem):
                errors.append(RowError(ref, row_id, enc.code, enc.message, "tokenize"))
            else:
                valid.append((ref, row_id, enc.length, ()))
    return _assemble(job, loaded, ids, valid, errors)


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


def _assemble(job: JobConfig, loaded: LoadedInput, ids: list[Any], valid: list[tuple[Ref, Any, int]],
              errors: list[RowError]) -> Plan:
    edges = bucket_edges(job)
    batch, shard_size = job.runtime.max_batch_size, job.runtime.shard_size
    members: dict[int, list[tuple[Ref, Any, int]]] = {}
    for row in valid:
        members.setdefault(_bucket_of(row[2], edges), []).append(row)
    shards, buckets = [], []
    for b in sorted(members, reverse=True):  # longest buckets first: the slow shards start early
        # longest first, then input order; with prefix reuse, rows sharing a prefix become neighbours
        # first, so they land in one shard and one batch (a cache hit is planned, not left to chance)
        rows = sorted(members[b], key=lambda r: (r[3], -r[2], r[0]))
        summary = BucketSummary(b, edges[b - 1] + 1 if b else 1, edges[b], rows=len(rows),
                                input_tokens=sum(r[2] for r in rows),
                                est_padding_efficiency=padding_efficiency([r[2] for r in rows], batch, presorted=True))
        for seq, start in enumerate(range(0, len(rows), shard_size)):
            chunk = rows[start : start + shard_size]
            lens = [r[2] for r in chunk]
            shards.append(ShardSpec(_shard_id(f"b{b:02d}", seq, [r[1] for r in chunk]), "generate", b,
                                    summary.min_len, summary.max_len, tuple(r[0] for r in chunk), sum(lens),
                                    padding_efficiency(lens, batch, presorted=True)))
            summary.shards += 1
        buckets.append(summary)
    error_shards, row_errors = [], {}
    errors.sort(key=lambda e: e.ref)
    for seq, start in enumerate(range(0, len(errors), shard_size)):
        chunk = errors[start : start + shard_size]
        spec = ShardSpec(_shard_id("err", seq, [e.id for e in chunk]), "invalid", -1, 0, 0,
                         tuple(e.ref for e in chunk), 0, 1.0)
        error_shards.append(spec)
        row_errors[spec.shard_id] = chunk
    in_order = [r[2] for r in sorted(valid, key=lambda r: r[0])]
    ref_ids = {r[0]: r[1] for r in valid} | {e.ref: e.id for e in errors}
    plan = Plan(loaded.files, loaded.id_kind, ids, shards, error_shards, row_errors, buckets,
                Counter(e.code for e in errors), ref_ids,
                padding_bucketed=_weighted_padding(shards, batch, valid),
                padding_unbucketed=padding_efficiency(in_order, batch, presorted=False),
                shared_token_fraction=_shared_fraction(shards, valid, job.runtime.segment_size))
    log.info("plan: %d rows, %d valid in %d shards, %d error rows; padding efficiency %.3f bucketed vs %.3f not",
             plan.num_rows, len(valid), len(shards), len(errors), plan.padding_bucketed, plan.padding_unbucketed)
    return plan


def _shared_fraction(shards: list[ShardSpec], valid: list[tuple], segment: int) -> float:
    """Prompt tokens in blocks that another row of the same shard also starts with."""
    by_ref = {r[0]: r for r in valid}
    shared = total = 0
    for s in shards:
        rows = [by_ref[ref] for ref in s.refs]
        counts = Counter(key for r in rows for key in r[3])
        total += sum(r[2] for r in rows)
        shared += sum(segment * sum(1 for key in r[3] if counts[key] > 1) for r in rows)
    return shared / total if total else 0.0


def _weighted_padding(shards: list[ShardSpec], batch: int, valid: list[tuple[Ref, Any, int]]) -> float:
    by_ref = {r[0]: r[2] for r in valid}
    useful = computed = 0
    for s in shards:
        lens = sorted((by_ref[ref] for ref in s.refs), reverse=True)
        useful += sum(lens)
        computed += _padded_slots(lens, batch)
    return useful / computed if computed else 1.0


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
