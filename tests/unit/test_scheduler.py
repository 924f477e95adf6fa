"""The scheduler alone, driven by a runner that is plain Python: it loads no torch, and its plans keep
every row's KV inside the arena, give each row its own tokens and leave the allocator whole."""

import random
import subprocess
import sys

import pytest

from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.runtime.params import SamplingParams
from flashx_batch.runtime.plan import ExtentDecode, ExtentPrefill, SlotMove, StepOutput, StripeDecode, StripePrefill
from flashx_batch.runtime.results import GenerateStats
from flashx_batch.runtime.rows import Row
from flashx_batch.runtime.scheduler import Scheduler, SchedulerConfig


def test_the_scheduler_imports_no_torch():
    code = "import sys, flashx_batch.runtime.scheduler; sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


class ListRunner:
    """Mirrors the live rows as Python lists: each row's token is a function of (row, step), so a row that
    got another row's token, or a step out of order, shows in its output. Checks every slot it is told to
    touch lies inside the rows' own KV."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots, self.live = num_slots, []  # live: (row id, steps so far)
        self.owner = [None] * num_slots  # which row's KV sits in each slot

    def run(self, plan):
        if plan.keep is not None:
            self.live = [self.live[i] for i in plan.keep]
        for op in plan.kv_ops:
            if isinstance(op, SlotMove):
                assert 0 <= op.src and op.src + op.n <= self.num_slots and op.dst + op.n <= self.num_slots
                moved = self.owner[op.src : op.src + op.n]
                self.owner[op.dst : op.dst + op.n] = moved
        if plan.prefill is not None:
            p = plan.prefill
            ids = [r.prompt[0] for r in p.rows]  # each test prompt starts with its row id
            if isinstance(p, StripePrefill):
                starts = [(p.first + k) * p.capacity for k in range(len(ids))]
            else:
                assert isinstance(p, ExtentPrefill)
                starts = list(p.starts)
            for row_id, start, r in zip(ids, starts, p.rows):
                assert start + len(r.prompt) <= self.num_slots
                self.owner[start : start + len(r.prompt)] = [row_id] * len(r.prompt)
            self.live += [(row_id, 0) for row_id in ids]
            return StepOutput([1000 * row_id for row_id in ids], [len(r.prompt) for r in p.rows],
                              sum(len(r.prompt) for r in p.rows))
        if plan.decode is not None:
            d = plan.decode
            assert len(d.positions) == len(self.live)
            if isinstance(d, StripeDecode):
                starts = [i * d.capacity for i in range(len(self.live))]
            else:
                assert isinstance(d, ExtentDecode)
                starts = list(d.starts)
            for (row_id, _), start, pos in zip(self.live, starts, d.positions):
                assert self.owner[start] == row_id, "a row read another row's KV"
                self.owner[start + pos] = row_id
            self.live = [(row_id, step + 1) for row_id, step in self.live]
            return StepOutput([1000 * row_id + step for row_id, step in self.live])
        return StepOutput([])


@pytest.mark.parametrize(("extents", "refill", "sort"), [(True, True, True), (True, True, False),
                                                         (False, True, True), (False, True, False),
                                                         (False, False, True)])
def test_plans_keep_rows_apart_and_the_allocator_whole(extents, refill, sort):
    geometry = ArenaGeometry(segment_size=8, base_rows=4, base_capacity=96)
    config = SchedulerConfig(max_input_len=64, prompt_slots=64, refill=refill, sort_by_length=sort, batch_growth=4,
                             grows_batches=True, uses_extents=extents, segment_bytes=8, layer_slot_bytes=1,
                             split_min_bytes=None)
    scheduler = Scheduler(config, geometry, eos_token_ids=(), decode_text=lambda ids: "")
    rng = random.Random(f"{extents}{refill}{sort}")
    rows = []
    for i in range(40):
        new = rng.randint(1, 32)
        prompt = [i + 1] + [7] * rng.randint(0, 63)
        rows.append(Row(i, prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), len(prompt) + new))
    stats = GenerateStats()
    runner = ListRunner(geometry.num_slots)
    scheduler.start(rows, stats)
    while (plan := scheduler.schedule()) is not None:
        scheduler.postprocess(plan, runner.run(plan))
    for row in rows:
        row_id, new = row.index + 1, row.params.max_new_tokens
        assert row.state.token_ids == [1000 * row_id + k for k in range(new)]
        assert row.state.finish_reason == "length"
    assert scheduler.allocator.is_whole() and runner.live == []
    assert stats.rows == 40 and stats.output_tokens == sum(r.params.max_new_tokens for r in rows)
    if refill and (extents or sort):  # growing batches took more rows than the base layout (stripes in arrival
        assert stats.peak_rows > geometry.base_rows  # order stay cut for the longest row still queued)
    assert (geometry.max_rows, geometry.row_capacity) == (4, 96)  # back in the base layout


def _run(rows, extents, sort=True):
    geometry = ArenaGeometry(segment_size=8, base_rows=4, base_capacity=96)
    config = SchedulerConfig(max_input_len=64, prompt_slots=64, refill=True, sort_by_length=sort, batch_growth=4,
                             grows_batches=True, uses_extents=extents, segment_bytes=8, layer_slot_bytes=1,
                             split_min_bytes=None)
    scheduler = Scheduler(config, geometry, eos_token_ids=(), decode_text=lambda ids: "")
    stats, runner, admitted = GenerateStats(), ListRunner(geometry.num_slots), []
    scheduler.start(rows, stats)
    while (plan := scheduler.schedule()) is not None:
        if plan.prefill is not None:
            admitted += [r.prompt[0] - 1 for r in plan.prefill.rows]
        scheduler.postprocess(plan, runner.run(plan))
    assert scheduler.allocator.is_whole()
    return stats, admitted


def _mixed_rows(seed, n=48):
    rng, rows = random.Random(seed), []
    for i in range(n):
        new = rng.randint(4, 40)
        prompt = [i + 1] + [7] * rng.randint(0, 63)
        rows.append(Row(i, prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), len(prompt) + new))
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_extent_batches_start_the_longest_lived_rows_first_and_take_fewer_steps(seed, monkeypatch):
    """Sorted extents admit rows by new tokens (then slots), most first: the rows that decode longest start
    first, so the batch's tail is short. On a mixed intake that takes fewer decode steps than the slot order
    stripes use, each step reading the same weights."""
    from flashx_batch.runtime import scheduler as scheduler_module

    rows = _mixed_rows(seed)
    stats, admitted = _run(rows, extents=True)
    new = [rows[i].params.max_new_tokens for i in admitted]
    assert new == sorted(new, reverse=True) and sorted(admitted) == list(range(len(rows)))
    by_slots = scheduler_module.bucket_key
    monkeypatch.setattr(scheduler_module, "bucket_key",
                        lambda need, new_tokens, extents: by_slots(need, new_tokens, False))
    slot_order, admitted_by_slots = _run(_mixed_rows(seed), extents=True)
    needs = [rows[i].need for i in admitted_by_slots]
    assert needs == sorted(needs, reverse=True)
    assert stats.decode_steps < slot_order.decode_steps
    assert stats.output_tokens == slot_order.output_tokens


def test_stripes_keep_the_slot_order():
    """Stripes are cut for the longest row: bucketing keeps batch-mates alike by slots held at the end."""
    rows = _mixed_rows(9)
    _, admitted = _run(rows, extents=False)
    needs = [rows[i].need for i in admitted]
    assert needs == sorted(needs, reverse=True)
