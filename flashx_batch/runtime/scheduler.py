"""`Scheduler`: which rows run, where their KV lives, and what the runner does next — no tensors.

One per engine (so one per Ray actor). `generate` hands it the call's rows; the engine then loops

    plan = scheduler.schedule()      # a `StepPlan`: rows that stay, KV copies, a prefill or a decode step
    out = runner.run(plan)           # the device work; sampled token ids back
    scheduler.postprocess(plan, out) # tokens appended, stops found, finished rows leave

until `schedule` returns None. Batching: rows are sorted longest first (bucketing: by the KV slots each
ends with, or under extents by new tokens, `bucket_key`) — or by prompt under prefix reuse, so rows sharing a prefix
become batch-mates — and fill the KV arena in one of three layouts (`runtime.layouts`). A finished
row leaves at once, and with refill the next queued rows are prefilled into the freed KV between two
decode steps, so a shard runs as one batch that stays full until its queue runs dry; without refill
(or with prefix reuse) the queue is cut into static batches. Glossary: docs/architecture.md.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashx_batch.kvcache.allocator import SegmentAllocator
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.kvcache.prefix_cache import PrefixCache
from flashx_batch.runtime.layouts.base import Layout
from flashx_batch.runtime.layouts.extents import ExtentLayout
from flashx_batch.runtime.layouts.paged import PagedLayout, share_prefixes
from flashx_batch.runtime.layouts.stripes import StripeLayout
from flashx_batch.runtime.plan import DecodeStep, KVOp, Prefill, StepOutput, StepPlan
from flashx_batch.runtime.results import GenerateStats, KVAccount
from flashx_batch.runtime.rows import Row
from flashx_batch.runtime.stops import RowState

PAGED_GROWTH = 4  # a batch of rows sharing cached prefixes may hold up to 4 x the base rows


def bucket_key(need: int, new_tokens: int, extents: bool) -> tuple[int, ...]:
    """Bucketing's order (ascending keys run first) for a row ending with `need` KV slots after `new_tokens`.
    Stripes: most slots first, so batch-mates' stripes are cut alike. Extents (each row sized to itself): most
    new tokens first, then most slots. The rows that decode longest start first and the batch's tail, where
    a few rows decode alone, is short (longest-processing-time order). The benchmark's mixed intake took 19 % fewer
    decode steps than ordered by slots (`bench.schedule_count`), and 11-24 % over six seeds of it in a count."""
    return (-new_tokens, -need) if extents else (-need,)


@dataclass(frozen=True)
class SchedulerConfig:
    max_input_len: int
    prompt_slots: int  # the most KV slots a prompt holds once cached (a rolling merge folds a long one into it)
    refill: bool  # in-flight refill (never with prefix reuse: see `refills`)
    sort_by_length: bool
    batch_growth: int
    grows_batches: bool  # shorter rows run more at once in the same KV bytes (static cache, no prefix reuse)
    uses_extents: bool  # refilled growing batches keep each row in an extent of its own
    segment_bytes: int  # KV bytes of one segment, all layers (kv_bytes_peak)
    layer_slot_bytes: int  # KV bytes of one slot of one layer (what attention reads per slot and layer)
    split_min_bytes: int | None  # decode attention in two runs when that saves reading this much


class Scheduler:
    def __init__(self, config: SchedulerConfig, geometry: ArenaGeometry, eos_token_ids: tuple[int, ...],
                 decode_text: Callable[[list[int]], str], prefix_reuse: bool = False) -> None:
        """`prefix_reuse`: the arena's segments past the stripe region hold a prefix cache, and its
        last segment is the paged batches' trash segment (see `kv_sizing.arena_geometry`)."""
        self.config, self.geometry = config, geometry
        # the engine's `runtime.grammar.GrammarBook` once a call has constrained rows: a matcher per admitted
        # constrained row, and each step's masks (`masks_for`)
        self.grammars: Any = None
        self.eos_token_ids, self.decode_text = eos_token_ids, decode_text
        self.allocator = SegmentAllocator(geometry.num_segments, geometry.segment_size)
        self.prefix_cache: PrefixCache | None = None
        self.trash_slot = -1  # paged batches only: where padding positions write (the arena's last segment)
        if prefix_reuse:
            last = geometry.num_segments - 1
            self.trash_slot = last * geometry.segment_size
            first = geometry.striped_segments
            self.prefix_cache = PrefixCache(self.allocator, range(first, last), last - first)
            self.allocator.take([last])  # the trash segment is never handed out
        self._reset(GenerateStats())

    @property
    def refills(self) -> bool:
        """In-flight refill: not under prefix reuse, where a striped batch is a fallback and the rows
        after it may share prefixes again in a paged batch."""
        return self.config.refill and self.prefix_cache is None

    def _reset(self, stats: GenerateStats) -> None:
        self.stats, self.account = stats, KVAccount(stats, self.config.segment_bytes)
        self.queue: deque[Row] = deque()
        self.longest_from: dict[int, int] = {}
        self.batch: Layout | None = None
        self.batch_rows: list[Row] = []  # every row the current batch admitted
        self.batch_start = 0
        self.joining: list[Row] = []  # rows of the plan in flight's prefill
        self.pending_keep: tuple[int, ...] | None = None  # drops since the last plan, for the next one
        self.pending_ops: list[KVOp] = []
        self.in_refill = False

    # ---- the loop ---------------------------------------------------------------------------
    def start(self, rows: list[Row], stats: GenerateStats) -> None:
        """Queue one `generate` call's rows (sorted, see the module doc)."""
        self._reset(stats)
        order = list(rows)
        if self.prefix_cache is not None:  # rows sharing a prefix become neighbours, then batch-mates
            order.sort(key=lambda r: (r.adapter, r.prompt))  # a prefix is shared within one LoRA adapter
        elif self.config.sort_by_length:
            order.sort(key=lambda r: bucket_key(r.need, r.params.max_new_tokens, self.config.uses_extents))
        self.queue = deque(order)
        # per row: the most KV slots any row from it to the end of the queue will hold (growing stripes
        # are cut no shorter, so no queued row ever waits for room)
        longest = 0
        for row in reversed(order):
            longest = self.longest_from[row.index] = max(longest, row.need)

    def schedule(self) -> StepPlan | None:
        """The next plan for the runner; None when every row of the call is done."""
        if self.batch is None:
            if not self.queue:
                return None
            self.batch, rows = self._next_batch()
            self.batch_start, self.batch_rows, self.in_refill = len(rows), [], False
            return self._admit(rows)
        batch = self.batch
        refill = self.queue if self.refills else None
        if refill and not self.in_refill and batch.joinable(refill):
            self.pending_ops += batch.before_refill(refill)  # growing stripes: re-cut for the rows left
            self.in_refill = True
        if self.in_refill:
            take = batch.joinable(refill) if refill else 0
            if take:  # rows that stop on their first token free room again: the round goes on
                return self._admit([refill.popleft() for _ in range(take)])
            self.in_refill = False
        if batch.rows:
            return self._plan(decode=batch.decode())
        self._finish_batch()
        return self._plan()  # the last drops (their KV copies) close the batch

    def postprocess(self, plan: StepPlan, out: StepOutput) -> None:
        """The runner ran `plan`: record the sampled tokens, find the rows that stopped, let them leave."""
        batch, stats = self.batch, self.stats
        if plan.prefill is not None:
            rows, self.joining = self.joining, []
            base = len(batch.rows)
            batch.admitted(rows, out.slots or [len(r.prompt) for r in rows])
            self.batch_rows += rows
            stats.computed_slots += out.computed
            stats.peak_rows = max(stats.peak_rows, len(batch.rows))
            finished = []
            for k, (row, token) in enumerate(zip(rows, out.tokens)):
                row.state = RowState.start(row.params, self.eos_token_ids, row.grammar)
                if out.logprobs is not None:
                    row.state.record_logprobs(out.logprobs[k], out.top_logprobs[k])
                if row.state.append(token, self.decode_text):
                    finished.append(base + k)
        elif plan.decode is not None:
            batch.stepped()
            stats.decode_steps += 1
            stats.computed_slots += out.computed
            if out.logprobs is not None:
                for row, logprob, top in zip(batch.rows, out.logprobs, out.top_logprobs):
                    row.state.record_logprobs(logprob, top)
            finished = [j for j, (row, token) in enumerate(zip(batch.rows, out.tokens))
                        if row.state.append(token, self.decode_text)]
        else:
            return
        if finished:
            now = time.perf_counter()
            stats.row_latency_s.extend(now - batch.rows[j].began for j in finished)
            keep, ops = batch.drop(finished)
            self.pending_keep = tuple(keep)
            self.pending_ops += ops

    def masks_for(self, plan: StepPlan) -> Any:
        """The grammar masks of the rows `plan` samples (its prefill's, or every live row), in batch order;
        None when none of them is constrained."""
        if self.grammars is None:
            return None
        rows = self.joining if plan.prefill is not None else self.batch.rows if plan.decode is not None else []
        return self.grammars.masks([r.grammar for r in rows]) if rows else None

    def abort(self) -> None:
        """A plan failed: give every segment of the batch back (the runner drops its own state)."""
        if self.batch is not None:
            self.batch.release()
        self._reset(self.stats)

    # ---- internals --------------------------------------------------------------------------
    def _plan(self, ops: list[KVOp] | None = None, prefill: Prefill | None = None,
              decode: DecodeStep | None = None) -> StepPlan:
        plan = StepPlan(self.pending_keep, tuple(self.pending_ops + (ops or [])), prefill, decode)
        self.pending_keep, self.pending_ops = None, []
        return plan

    def _admit(self, rows: list[Row]) -> StepPlan:
        now = time.perf_counter()
        for row in rows:
            row.began = now
            constraint = row.params.constraint
            if constraint is not None and row.grammar is None:
                row.grammar = self.grammars.matcher(constraint)
        ops, prefill = self.batch.admit(rows)
        self.joining = rows
        return self._plan(ops, prefill=prefill)

    def _finish_batch(self) -> None:
        stats, rows = self.stats, self.batch_rows
        stats.rows += len(rows)
        stats.batches += 1
        stats.batch_sizes.append(self.batch_start)
        stats.input_tokens += sum(len(r.prompt) for r in rows)
        stats.output_tokens += sum(len(r.state.token_ids) for r in rows)
        self.batch.release()
        self.batch = None

    def _next_batch(self) -> tuple[Layout, list[Row]]:
        """The next batch's layout and first rows, off the front of the queue.

        Paged (rows share cached prefix segments): a row only needs segments for its own suffix and new
        tokens, so as many rows as the stripe region can hold join — up to PAGED_GROWTH x the base rows
        — which is where prefix sharing saves memory. Extents: as many rows as fit. Stripes: a layout's
        worth of rows."""
        config, geometry, queue = self.config, self.geometry, self.queue
        size = geometry.base_rows
        if self.prefix_cache is not None:
            candidates = list(itertools.islice(queue, size * PAGED_GROWTH))
            if all(len(r.prompt) <= config.max_input_len for r in candidates):
                found = share_prefixes(self.prefix_cache, self.allocator, geometry.segment_size,
                                       [r.prompt for r in candidates], [r.adapter for r in candidates])
                if found is not None:
                    try:
                        fit = self._paged_fit(candidates, found.shared, size)
                    except BaseException:  # nothing owns `found` yet
                        found.discard(self.allocator, self.prefix_cache)
                        raise
                    rest, found.shared = found.shared[fit:], found.shared[:fit]
                    for segments in rest:  # rows left for the next batch drop their references
                        self.allocator.release(segments)
                    layout = PagedLayout(geometry, self.allocator, self.account, self.prefix_cache,
                                         self.trash_slot, found)  # owns `found`: `release` gives it back
                    return layout, [queue.popleft() for _ in range(fit)]
        if config.uses_extents:
            layout = ExtentLayout(geometry, self.allocator, self.account, config.batch_growth)
            return layout, [queue.popleft() for _ in range(max(1, layout.joinable(queue)))]
        longest_from = self.longest_from if config.grows_batches and self.refills else None
        if config.grows_batches:
            geometry.set_layout(*self._first_layout(longest_from))
            size = geometry.max_rows
        layout = StripeLayout(geometry, self.allocator, self.account, config.batch_growth, longest_from,
                              config.layer_slot_bytes, config.split_min_bytes)
        return layout, [queue.popleft() for _ in range(min(size, len(queue)))]

    def _first_layout(self, longest_from: dict[int, int] | None) -> tuple[int, int]:
        """The layout a growing striped batch starts in. Refilled: stripes for the longest row still
        queued, since every one of them may join this batch. Static batches: for the longest of the
        rows this batch takes, shrinking the row count until they all fit."""
        growth, queue = self.config.batch_growth, self.queue
        if longest_from is not None:
            return self.geometry.layout_for(longest_from[queue[0].index], growth)
        need = queue[0].need
        while True:
            capacity, rows = self.geometry.layout_for(need, growth)
            longest = max(r.need for r in itertools.islice(queue, rows))
            if longest <= capacity:
                return capacity, rows
            need = longest

    def _paged_fit(self, rows: list[Row], shared: list[list[int]], at_least: int) -> int:
        """How many leading rows' own segments fit in the stripe region (at least `at_least`)."""
        g = self.geometry
        free = self.allocator.free_in(range(g.striped_segments))
        need, fit = 0, 0
        for row, segments in zip(rows, shared):
            need += g.segments_for(len(row.prompt) - len(segments) * g.segment_size + row.params.max_new_tokens)
            if need > free:
                break
            fit += 1
        return max(fit, min(at_least, len(rows)))
