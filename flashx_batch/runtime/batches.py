"""One batch on the device: how its prompts get into the KV arena and how it steps.

`Engine._run_batch` drives every kind through the same four calls — `prefill()`, `step(tokens)`,
`drop(finished)`, `release()` — and keeps the sampling and stop bookkeeping to itself; striped and
extent batches also take `admit(prompts, params)` (in-flight refill) for as many queued rows as
`joinable(queue)` says fit.

- `ExtentBatch`: static cache on CPU (`kv_layout`): row i lives in a contiguous extent of its own
  prompt + new tokens, anywhere in the stripe region; attention reads each run of rows in place.
- `StripedBatch`: row i lives in stripe i (segment-sparse merging, rolling merge, static cache on
  other backends). Attention reads the stripes as one strided view; a finished row's stripe is
  refilled by the last active row so the active rows stay a dense prefix, and new rows are admitted
  after them.
- `PagedBatch`: rows share read-only prefix segments from the `PrefixCache`; each row's slot table
  is its shared segments followed by its own, and attention gathers through the table.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

import torch

from flashx_batch.runtime.kv import ArenaFullError
from flashx_batch.runtime.kv_merge import apply_plans, choose_compression, plan_groups
from flashx_batch.runtime.prefix_cache import block_keys
from flashx_batch.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from flashx_batch.runtime.engine import Engine, GenerateStats


# a mid-batch re-cut of the stripes must add at least this share of rows (each re-cut copies the live KV)
REGRID_GAIN = 0.25


def attention_groups(lengths: list[int], bytes_per_slot: int, min_bytes: int | None
                     ) -> tuple[tuple[int, int, int], ...] | None:
    """How one decode step's attention reads the stripes: None for one call over every row up to
    the longest row's `lengths` (visible slots per row, in stripe order), else two contiguous runs
    of rows (start, end, visible slots), each read only up to its own longest row.

    Masked slots past a row's end are read all the same by one call; rows of mixed lengths (the
    rows a refill brings in are shorter than those already decoding) can waste a third of those
    reads. The cut is the one that reads least, taken when it saves at least `min_bytes` of one
    layer's cache (`bytes_per_slot`: keys + values of one slot of one layer; the backend's
    `attention_split_min_bytes`, None: never split). Each row attends to its own slots either
    way: logits equal up to float rounding (SDPA blocks the keys differently), tokens equal in
    the tests."""
    n = len(lengths)
    if n < 2 or min_bytes is None:
        return None
    suffix = lengths[:]
    for i in range(n - 2, -1, -1):
        suffix[i] = max(suffix[i], suffix[i + 1])
    whole, best, cut, head = n * suffix[0], n * suffix[0], 0, 0
    for k in range(1, n):
        head = max(head, lengths[k - 1])
        reads = k * head + (n - k) * suffix[k]
        if reads < best:
            best, cut = reads, k
    if best == whole or (whole - best) * bytes_per_slot < min_bytes:
        return None
    return (0, cut, max(lengths[:cut])), (cut, n, suffix[cut])


class StripedBatch:
    def __init__(self, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 stats: GenerateStats, longest_from: dict[int, int] | None = None) -> None:
        # the rows the batch starts with; rows admitted later are tracked by position (slots, held)
        self.engine, self.prompts, self.params, self.stats = engine, prompts, params, stats
        # growing batches: the most KV slots any queued row from a given one on will hold (`regrid`)
        self.longest_from = longest_from
        self.runner, self.arena = engine.runner, engine.runner.arena
        self.held: list[list[int]] = []
        self.static_need: list[int] = []  # per batch position: segments a static cache would hold
        self.slots: list[int] = []  # cache slots per batch position
        self.positions = self.write_slots = None

    @property
    def size(self) -> int:
        return len(self.slots)

    def prefill(self) -> torch.Tensor:
        logits, self.slots = self._fill()
        allocator, device = self.arena.allocator, self.engine.device
        # segments held per row: its (possibly merged) prompt plus room for every new token
        self.held = [self._take_stripe(i, allocator.segments_for(n + p.max_new_tokens))
                     for i, (n, p) in enumerate(zip(self.slots, self.params))]
        self.static_need = [allocator.segments_for(len(t) + p.max_new_tokens)
                            for t, p in zip(self.prompts, self.params)]
        self._record_kv()
        lengths = [len(p) for p in self.prompts]
        self.positions = torch.tensor(lengths, dtype=torch.long, device=device)
        # merged rows: RoPE positions (true token counts) and cache slots part ways
        if self.slots != lengths:
            self.write_slots = torch.tensor(self.slots, dtype=torch.long, device=device)
        return logits

    @property
    def room(self) -> int:
        """Free stripes `admit` can fill (in-flight refill)."""
        return self.arena.max_rows - self.size

    def joinable(self, queue: deque[int]) -> int:
        """How many rows from the front of `queue` `admit` can take now."""
        return min(self.room, len(queue))

    def prepare_refill(self, queue: deque[int]) -> None:
        """Before a refill: a growing batch re-cuts its stripes when the rows left allow shorter ones."""
        if self.longest_from is not None:
            self.regrid(self.longest_from[queue[0]])

    def admit(self, prompts: list[list[int]], params: list[SamplingParams]) -> torch.Tensor:
        """Prefill more rows into the first free stripes while the others are mid-decode (in-flight
        refill: a finished row's stripe goes to the next queued row instead of idling until the
        batch ends). Returns their last-token logits [k, V]; they decode from the next step on."""
        first, cap, allocator, device = self.size, self.arena.row_capacity, self.arena.allocator, self.engine.device
        # a stripe's previous occupant may have left merge biases where this row will decode
        self.arena.bias[first * cap : (first + len(prompts)) * cap] = 0.0
        logits, used = self._fill_rows(first, prompts)
        for j, (prompt, p, n) in enumerate(zip(prompts, params, used), start=first):
            needed = allocator.segments_for(n + p.max_new_tokens)
            self.held.append(self._take_stripe(j, needed))  # first: `release` frees it
            self.slots.append(n)
            self.static_need.append(allocator.segments_for(len(prompt) + p.max_new_tokens))
        self._record_kv()
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        if self.write_slots is not None or used != lengths.tolist():
            before = self.write_slots if self.write_slots is not None else self.positions.clone()
            self.write_slots = torch.cat((before, torch.tensor(used, dtype=torch.long, device=device)))
        self.positions = torch.cat((self.positions, lengths))
        return logits

    def _record_kv(self) -> None:
        self.engine._record_kv(self.stats, sum(map(len, self.held)), sum(self.static_need))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        longest = max(self.slots)
        groups = attention_groups([n + 1 for n in self.slots], self.arena.layer_slot_bytes(),
                                  self.engine.backend.attention_split_min_bytes)
        logits = self.runner.decode(tokens, self.positions, longest + 1, self.write_slots,
                                    aligned=min(self.slots) == longest, groups=groups)
        self.positions += 1
        if self.write_slots is not None:
            self.write_slots += 1
        self.slots = [n + 1 for n in self.slots]
        return logits

    def drop(self, finished: list[int]) -> list[int]:
        """Free finished positions; the last active rows move into the holes. Returns, for each new
        position, its old position. A moved row re-takes as many segments in its new stripe."""
        allocator = self.arena.allocator
        old_of = list(range(self.size))
        for j in sorted(finished, reverse=True):
            last = self.size - 1
            allocator.release(self.held[j])
            if j != last:
                self.runner.move_row(last, j, self.slots[last])
                allocator.release(self.held[last])
                self.held[j] = self._take_stripe(j, len(self.held[last]))
                self.slots[j], old_of[j] = self.slots[last], old_of[last]
                self.static_need[j] = self.static_need[last]
            for seq in (self.held, self.slots, old_of, self.static_need):
                seq.pop()
        keep = torch.tensor(old_of, dtype=torch.long, device=self.engine.device)
        self.positions = self.positions[keep]
        if self.write_slots is not None:
            self.write_slots = self.write_slots[keep]
        return old_of

    def release(self) -> None:
        self.arena.set_layout(self.arena.base_capacity, self.arena.base_rows)  # the next batch starts whole
        for segments in self.held:
            self.arena.allocator.release(segments)
        self.held = []

    def regrid(self, next_slots: int) -> None:
        """Before a refill: when the rows still decoding and every queued row (at most `next_slots` KV
        slots at its end) fit shorter stripes that make room for at least a quarter more rows, re-cut
        the stripe region that way, moving the live rows' KV (one copy of it; cheaper than the decode
        steps the extra rows save). Positions and slot counts do not change, only where stripes start."""
        seg, arena = self.arena.segment_size, self.arena
        longest = max([len(h) * seg for h in self.held] + [next_slots])
        capacity, rows = self.engine.layout_for(longest)
        if rows < arena.max_rows + max(1, int(arena.max_rows * REGRID_GAIN)):
            return
        arena.relayout(self.slots, capacity, rows)  # first: if it fails, `held` still matches the allocator
        allocator = arena.allocator
        for segments in self.held:
            allocator.release(segments)
        self.held = [self._take_stripe(j, len(h)) for j, h in enumerate(self.held)]
        self.stats.relayouts += 1

    def _take_stripe(self, row: int, segments: int) -> list[int]:
        """The first `segments` segments of stripe `row` in the current layout, refusing more than a
        stripe holds (a row must never write into the next stripe)."""
        if segments > self.arena.segments_per_row:
            raise ArenaFullError(f"row {row} needs {segments} segments, its stripe holds {self.arena.segments_per_row}")
        return self.arena.allocator.take(self.arena.stripe_segments(row)[:segments])

    def _fill(self) -> tuple[torch.Tensor, list[int]]:
        """Prompts' KV into stripes 0..B-1 -> (last-token logits [B, V], cache slots per row).

        A row never needs more than its stripe once it is done (see `_fill_rows`).
        """
        self.arena.bias.zero_()
        return self._fill_rows(0, self.prompts)

    def _fill_rows(self, first: int, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Prompts into stripes first, first + 1, ... -> (last-token logits [B, V], cache slots per row).

        Plain rows: one prefill, packed end to end without padding. Segment-sparse rows: packed
        prefills into free space, each row then merged down into its stripe (`_fill_merged`). A row
        longer than max_input_len (rolling merge) is prefilled alone, between the runs of rows that
        fit (`_fill_rolling`)."""
        limit = self.engine.options.max_input_len
        sparse = self.engine.options.cache_policy == "segment_sparse"
        last_logits, slots, i = [], [], 0
        while i < len(prompts):  # runs of rows that fit, packed; an over-long row alone (rolling merge)
            if len(prompts[i]) > limit:
                logits, used = self._fill_rolling(first + i, prompts[i])
                last_logits.append(logits[None])
                slots.append(used)
                i += 1
                continue
            run = 1
            while i + run < len(prompts) and len(prompts[i + run]) <= limit:
                run += 1
            rows = prompts[i : i + run]
            self.stats.computed_slots += sum(map(len, rows))
            if sparse:
                logits, used_slots = self._fill_merged(first + i, rows)
            else:
                logits, used_slots = self.runner.prefill_packed(rows, first + i), [len(p) for p in rows]
            last_logits.append(logits)
            slots += used_slots
            i += run
        return torch.cat(last_logits), slots

    def _fill_merged(self, first: int, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Segment-sparse rows into stripes first, first + 1, ...: as many rows as fit are prefilled
        in one packed pass, their full KV staged at the end of the free space (every stripe from
        `first` on, plus the spare segments), then merged down one by one, in stripe order, into
        their stripes. Staging at the end keeps each merge's destination clear of the rows still
        waiting: see `_staged_rows`."""
        engine, cap = self.engine, self.arena.row_capacity
        last_logits, slots, done = [], [], 0
        while done < len(prompts):
            row = first + done
            lengths = [len(p) for p in prompts[done:]]
            count = _staged_rows(row * cap, self.arena.num_slots, cap, lengths)
            starts = (self.arena.num_slots - torch.tensor(lengths[:count]).flip(0).cumsum(0).flip(0)).tolist()
            logits, scores = self.runner.prefill_packed_at(prompts[done : done + count], starts,
                                                           observe=engine.merge.window)
            jobs = []
            for j, (n, src, row_scores) in enumerate(zip(lengths, starts, scores)):
                merge, evict = choose_compression(row_scores, n, engine.merge)
                plan = plan_groups(n, merge, evict=evict)
                jobs.append((src, n, (row + j) * cap, plan))
            slots += apply_plans(self.arena, jobs, rotary=engine.merge_rotary)  # reads every row before writing
            last_logits.append(logits)
            done += count
        return torch.cat(last_logits), slots

    def _fill_rolling(self, i: int, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """A prompt longer than max_input_len (long_input=rolling_merge) alone into stripe i, folded
        into the slots a row of max_input_len would hold -> (last-token logits [V], cache slots)."""
        logits, used = self.engine.rolling_prefill(prompt, i * self.arena.row_capacity, self.engine.prompt_slots)
        self.stats.computed_slots += len(prompt)
        return logits[-1], used


def extent_runs(starts: list[int], sizes: list[int], lengths: list[int]
                ) -> tuple[tuple[int, int, int, int, int, bool], ...]:
    """How one decode step's attention reads rows that each have their own extent (`ExtentBatch`):
    runs of rows (first row, end row, first flat slot, stride, slots read, aligned), in batch order.

    Rows next to each other in the batch whose extents are equally long and follow one another in
    the arena form one run, read as one strided view up to the run's longest row (`aligned`: every
    row that long, so no mask); any other row is a run of its own, read exactly to its length."""
    runs: list[tuple[int, int, int, int, int, bool]] = []
    a = 0
    for i in range(1, len(starts) + 1):
        if i < len(starts) and sizes[i] == sizes[a] and starts[i] == starts[i - 1] + sizes[a]:
            continue
        run = lengths[a:i]
        longest = max(run)
        runs.append((a, i, starts[a], sizes[a] if i - a > 1 else longest, longest, min(run) == longest))
        a = i
    return tuple(runs)


class ExtentBatch:
    """Static-cache rows, each in one contiguous extent of the stripe region sized to its own
    prompt + new tokens (whole segments), instead of equal stripes cut for the longest row.

    A row joins whenever the free segments hold its extent (up to batch_growth x max_batch_size
    rows), so a long row still decoding no longer shortens what every other row may use — the
    decode steps a paged cache would take, without a gather: attention reads each row's extent in
    place, one call per run of rows (`extent_runs`). Extents are placed first-fit; when the free
    segments add up but no run of them is long enough, the live rows are moved to the front of the
    region (`compact`: each live row's KV copied once). Finished rows leave without moving anyone."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 stats: GenerateStats, needs: list[int]) -> None:
        # needs: KV slots each row of the engine's queue ends with (by row index), for `joinable`
        self.engine, self.prompts, self.params, self.stats, self.needs = engine, prompts, params, stats, needs
        self.runner, self.arena = engine.runner, engine.runner.arena
        self.region = range(self.arena.striped_segments)
        if self.arena.num_segments != self.arena.striped_segments:  # `joinable` counts every free segment
            raise ValueError("extent batches need an arena of stripes only (no prefix cache, no spare segments)")
        self.max_rows = self.arena.base_rows * engine.options.batch_growth
        self.extents: list[list[int]] = []  # per batch position: its segments, consecutive
        self.slots: list[int] = []  # cache slots per batch position (= RoPE position of the next token)

    @property
    def size(self) -> int:
        return len(self.slots)

    def prefill(self) -> torch.Tensor:
        return self.admit(self.prompts, self.params)

    def prepare_refill(self, queue: deque[int]) -> None:
        """Nothing to re-cut before a refill: every row has its own extent."""

    def joinable(self, queue: deque[int]) -> int:
        """How many rows from the front of `queue` (indices into `needs`) fit now, in order."""
        allocator = self.arena.allocator
        free, count = allocator.num_free, 0
        for i in itertools.islice(queue, self.max_rows - self.size):
            wanted = allocator.segments_for(self.needs[i])
            if wanted > free:
                break
            free -= wanted
            count += 1
        return count

    def admit(self, prompts: list[list[int]], params: list[SamplingParams]) -> torch.Tensor:
        """Prefill rows (packed, one pass) into new extents; returns their last-token logits [k, V]."""
        allocator = self.arena.allocator
        wanted = [allocator.segments_for(len(t) + p.max_new_tokens) for t, p in zip(prompts, params)]
        extents = self._place(wanted)
        if extents is None:  # the free segments add up (`joinable`), but not in long enough runs
            self.compact()
            extents = self._place(wanted)
            if extents is None:
                raise ArenaFullError(f"rows needing {wanted} segments do not fit the {allocator.num_free} free ones")
        seg = self.arena.segment_size
        self.extents += extents
        starts = [e[0] * seg for e in extents]
        self.stats.computed_slots += sum(map(len, prompts))
        logits = self.runner.prefill_packed_at(prompts, starts)[0]
        self.slots += [len(t) for t in prompts]
        held = sum(map(len, self.extents))
        self.engine._record_kv(self.stats, held, held)
        return logits

    def _place(self, wanted: list[int]) -> list[list[int]] | None:
        """First-fit extents for `wanted` segments each, all or none."""
        allocator, taken = self.arena.allocator, []
        for count in wanted:
            extent = allocator.allocate_run(count, self.region)
            if extent is None:
                for done in taken:
                    allocator.release(done)
                return None
            taken.append(extent)
        return taken

    def compact(self) -> None:
        """Move every live row's extent to the front of the region, in arena order, so the free
        segments become one run at the end. The bookkeeping moves first (it cannot fail half way),
        then the caches (`KVArena.move_slots`; in arena order a row's new place never reaches a later
        row's old one)."""
        arena, allocator, seg = self.arena, self.arena.allocator, self.arena.segment_size
        order = sorted(range(self.size), key=lambda j: self.extents[j][0])
        old = [self.extents[j][0] * seg for j in order]
        for extent in self.extents:
            allocator.release(extent)
        first = 0
        for j in order:
            count = len(self.extents[j])
            self.extents[j] = allocator.take(list(range(first, first + count)))
            first += count
        self.stats.relayouts += 1
        arena.move_slots([(src, self.extents[j][0] * seg, self.slots[j]) for j, src in zip(order, old)])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        seg, device = self.arena.segment_size, self.engine.device
        starts = [e[0] * seg for e in self.extents]
        runs = extent_runs(starts, [len(e) * seg for e in self.extents], [n + 1 for n in self.slots])
        logits = self.runner.decode_runs(tokens, torch.tensor(self.slots, dtype=torch.long, device=device),
                                         torch.tensor(starts, dtype=torch.long, device=device), runs)
        self.slots = [n + 1 for n in self.slots]
        return logits

    def drop(self, finished: list[int]) -> list[int]:
        gone = set(finished)
        keep = [j for j in range(self.size) if j not in gone]
        for j in finished:
            self.arena.allocator.release(self.extents[j])
        self.extents = [self.extents[j] for j in keep]
        self.slots = [self.slots[j] for j in keep]
        return keep

    def release(self) -> None:
        for extent in self.extents:
            self.arena.allocator.release(extent)
        self.extents = []


def _staged_rows(free_start: int, free_end: int, cap: int, lengths: list[int]) -> int:
    """How many of `lengths` (the next rows, stripe after stripe from `free_start`) one packed
    prefill can stage at the end of [free_start, free_end) and still merge safely in order: row j's
    merged slots, at most its stripe [free_start + j*cap, + cap), must end before the staged prompts
    of rows j+1.. begin (its own may overlap: a merge reads its source before writing). At least 1:
    the arena keeps the last stripe plus spare segments as long as the longest prompt."""
    count = 1
    while count < len(lengths):
        staged = lengths[: count + 1]
        if sum(staged) > free_end - free_start:
            break
        # row j's stripe end vs the first staged slot of row j + 1 (rows after j sit behind it)
        if any(free_start + (j + 1) * cap > free_end - sum(staged[j + 1 :]) for j in range(count + 1)):
            break
        count += 1
    return count


class PagedBatch:
    """Rows whose prompts start with blocks already in (or just added to) the prefix cache."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 stats: GenerateStats, shared: list[list[int]]) -> None:
        # the rows the batch starts with; rows admitted later are tracked by position (slots, held)
        self.engine, self.prompts, self.params, self.stats = engine, prompts, params, stats
        self.runner, self.arena, self.cache = engine.runner, engine.runner.arena, engine.prefix_cache
        self.seg = self.arena.segment_size
        self.shared = shared  # per row: cache segments it reads (one reference each, held by the row)
        self.own: list[list[int]] = []
        self.device = engine.device

    @property
    def size(self) -> int:
        return len(self.shared)

    def prefill(self) -> torch.Tensor:
        seg, allocator, trash = self.seg, self.arena.allocator, self.engine.trash_slot
        stripes = range(self.arena.striped_segments)
        cached = [len(s) * seg for s in self.shared]
        self.own = []  # filled row by row, so `release` frees exactly what was taken if this fails
        for p, c, q in zip(self.prompts, cached, self.params):
            self.own.append(allocator.allocate(allocator.segments_for(len(p) - c + q.max_new_tokens), within=stripes))
        self.engine._record_kv(self.stats, sum(map(len, self.own)) + len({s for r in self.shared for s in r}),
                               sum(allocator.segments_for(len(p) + q.max_new_tokens)
                                   for p, q in zip(self.prompts, self.params)))
        width = max(len(s) + len(o) for s, o in zip(self.shared, self.own)) * seg
        table = torch.full((self.size, width), trash, dtype=torch.long)
        for i, segments in enumerate(self.shared[i] + self.own[i] for i in range(self.size)):
            flat = (torch.tensor(segments)[:, None] * seg + torch.arange(seg)[None, :]).reshape(-1)
            table[i, : len(flat)] = flat
        self.table = table.to(self.device)
        suffixes = [p[c:] for p, c in zip(self.prompts, cached)]
        span = max(map(len, suffixes))
        tokens = torch.zeros(self.size, span, dtype=torch.long)
        positions = torch.zeros(self.size, span, dtype=torch.long)
        writes = torch.full((self.size, span), trash, dtype=torch.long)
        for i, (suffix, start) in enumerate(zip(suffixes, cached)):
            tokens[i, : len(suffix)] = torch.tensor(suffix)
            positions[i] = torch.arange(start, start + span)
            writes[i, : len(suffix)] = table[i, start : start + len(suffix)]
        positions = positions.clamp_max(width - 1)  # padding columns: any in-range position will do
        kv_len = max(len(p) for p in self.prompts)
        last = torch.tensor([len(s) - 1 for s in suffixes], device=self.device)
        logits = self.runner.paged(tokens.to(self.device), positions.to(self.device), writes.to(self.device),
                                   self.table[:, :kv_len], last)
        self.stats.computed_slots += self.size * span
        self.stats.cached_prompt_tokens += sum(cached)
        self.positions = torch.tensor([len(p) for p in self.prompts], device=self.device)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = self.positions[:, None]
        writes = self.table.gather(1, positions)
        kv_len = int(self.positions.max().item()) + 1
        last = torch.zeros(self.size, dtype=torch.long, device=self.device)
        logits = self.runner.paged(tokens[:, None], positions, writes, self.table[:, :kv_len], last)
        self.positions = self.positions + 1
        return logits

    def drop(self, finished: list[int]) -> list[int]:
        gone = set(finished)
        keep = [i for i in range(self.size) if i not in gone]
        for i in finished:  # a finished row gives its memory back at once
            self.arena.allocator.release(self.own[i] + self.shared[i])
        self.own = [self.own[i] for i in keep]
        self.shared = [self.shared[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.table, self.positions = self.table[index], self.positions[index]
        return keep

    def release(self) -> None:
        for segments in self.own + self.shared:
            self.arena.allocator.release(segments)
        self.own, self.shared = [], []


def share_prefixes(engine: Engine, prompts: list[list[int]], stats: GenerateStats) -> list[list[int]] | None:
    """Per row, the prefix-cache segments it can read instead of recomputing (one reference each).

    A block is shared when it is already cached or when two rows of this batch start with it; the
    first time it is needed it is computed once (reading the blocks before it) and cached. Each row
    keeps at least one token of its own to prefill. Returns None when no row shares anything.
    """
    cache, seg, runner = engine.prefix_cache, engine.runner.arena.segment_size, engine.runner
    allocator = engine.runner.arena.allocator
    keys = [block_keys(p, seg, len(p) - 1) for p in prompts]
    seen: dict[bytes, int] = {}
    for row in keys:
        for key in row:
            seen[key] = seen.get(key, 0) + 1
    shared: list[list[int]] = []
    try:
        for prompt, row_keys in zip(prompts, keys):
            segments = cache.match(row_keys)
            shared.append(segments)
            for segment in segments:  # the row's reference, taken at once: eviction must not pick them
                allocator.share(segment)
            wanted = len(segments)
            while wanted < len(row_keys) and seen[row_keys[wanted]] > 1:
                wanted += 1
            new = cache.reserve(wanted - len(segments)) if wanted > len(segments) else None
            if new is None:
                continue
            start = len(segments) * seg
            table = torch.tensor([s * seg + o for s in segments + new for o in range(seg)],
                                 device=engine.device)[None, : wanted * seg]
            tokens = prompt[start : wanted * seg]
            try:
                runner.paged(torch.tensor([tokens], device=engine.device),
                             torch.arange(start, wanted * seg, device=engine.device)[None],
                             table[:, start:], table, torch.tensor([len(tokens) - 1], device=engine.device))
            except BaseException:
                allocator.release(new)
                raise
            stats.computed_slots += len(tokens)
            stats.prefix_tokens_computed += len(tokens)
            for key, segment in zip(row_keys[len(segments) : wanted], new):
                cache.insert(key, segment)  # the reservation's reference becomes the cache's
                allocator.share(segment)
            segments.extend(new)
    except BaseException:
        for segments in shared:
            allocator.release(segments)
        raise
    if not any(shared):
        return None
    return shared
