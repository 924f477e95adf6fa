"""Length bucketing, shard cutting and the padding estimate."""

from __future__ import annotations

import pytest
from batch_support import sample_rows, tiny_model_dir, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.data import format_plan, load_inputs, plan_prompts
from flashx_batch.data.plan import bucket_edges, padding_efficiency
from flashx_batch.runtime.tokenizer import Tokenizer


def _plan(path, *overrides):
    job = compose_job(["conf=smoke", f"data.path={path}", "data.limit=null", "data.passthrough_columns=[]",
                       "data.passthrough_if_present=[]",
                       f"model.path={tiny_model_dir()}", *overrides])
    return plan_prompts(job, load_inputs(job.data, str(path)), Tokenizer(tiny_model_dir()))


def test_padding_efficiency_arithmetic():
    assert padding_efficiency([4, 4, 4, 4], 2, presorted=False) == 1.0
    # [8, 1] and [8, 1] in input order: 18 useful of 32 slots; sorted: [8, 8] [1, 1] = 18 of 18
    assert padding_efficiency([8, 1, 8, 1], 2, presorted=False) == pytest.approx(18 / 32)
    assert padding_efficiency([8, 1, 8, 1], 2, presorted=True) == 1.0


def test_bucket_edges_default_and_custom():
    job = compose_job(["conf=smoke", "runtime.max_input_len=100"])
    assert bucket_edges(job) == [16, 32, 64, 100]
    job = compose_job(["conf=smoke", "runtime.max_input_len=100", "runtime.bucket_edges=[50,10,500]"])
    assert bucket_edges(job) == [10, 50, 100]


def test_shards_are_bucketed_sized_and_stable(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", sample_rows(30))
    plan = _plan(path, "runtime.shard_size=4")
    again = _plan(path, "runtime.shard_size=4")
    assert [s.shard_id for s in plan.shards] == [s.shard_id for s in again.shards]  # stable across runs
    assert len({s.shard_id for s in plan.shards}) == len(plan.shards)
    assert all(1 <= s.num_rows <= 4 for s in plan.shards)
    assert sorted(r for s in plan.shards for r in s.refs) == [(0, i) for i in range(30)]
    # dispatch order: longest bucket first
    assert [s.bucket for s in plan.shards] == sorted((s.bucket for s in plan.shards), reverse=True)
    tok = Tokenizer(tiny_model_dir())
    rows = sample_rows(30)
    for s in plan.shards:
        lens = [len(tok.encode(rows[ri]["prompt"])) for _, ri in s.refs]
        assert all(s.bucket_min_len <= n <= s.bucket_max_len for n in lens)
    # a different shard size is a different plan: a shard's name changes whenever its members do
    other = {s.shard_id: s.refs for s in _plan(path, "runtime.shard_size=5").shards}
    mine = {s.shard_id: s.refs for s in plan.shards}
    assert other != mine
    assert all(other[k] == mine[k] for k in set(other) & set(mine))


def test_bucketing_beats_input_order_and_table_says_so(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", sample_rows(40))
    plan = _plan(path)
    assert plan.padding_bucketed > plan.padding_unbucketed
    text = format_plan(plan)
    assert f"with bucketing {plan.padding_bucketed:.3f}" in text
    assert f"without bucketing {plan.padding_unbucketed:.3f}" in text


def test_limit_takes_the_first_rows(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", sample_rows(30))
    plan = _plan(path, "data.limit=7")
    assert plan.ids == list(range(7)) and plan.num_valid == 7


@pytest.mark.parametrize("limit", ["null", "5"])
def test_an_empty_file_does_not_end_the_input(tmp_path, limit):
    """A file with no rows (sorting before the others) is skipped, not taken for the end of the input."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a-empty.csv").write_text("id,prompt\n")
    (tmp_path / "in" / "b.csv").write_text("id,prompt\n" + "".join(f"doc-{i},the law\n" for i in range(4)))
    (tmp_path / "in" / "c.csv").write_text("id,prompt\n" + "".join(f"doc-{i},the law\n" for i in range(4, 7)))
    plan = _plan(tmp_path / "in", "data.format=csv", f"data.limit={limit}")
    want = [f"doc-{i}" for i in range(7 if limit == "null" else 5)]
    assert list(plan.ids) == want and plan.num_valid == len(want)
