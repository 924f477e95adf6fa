"""`kv_budget_mb`: the KV arena sized in bytes, whatever the model's bytes per token — the full-length rows
that fit, never more bytes than the budget; segment-sparse admits more rows in the same bytes; a budget
too small for one row is refused with the sizes."""

import pytest

from flashx_batch import Engine
from flashx_batch.errors import ConfigError

OPTS = dict(backend="cpu", dtype="float32", max_input_len=128, max_output_len=32, segment_size=16)


def test_the_budget_decides_the_rows_and_bounds_the_arena():
    one_row = Engine.from_pretrained(None, max_batch_size=1, **OPTS).runner.kv_bytes
    for rows in (1, 3, 7):
        budget = (rows * one_row + one_row // 2) / 2**20  # room for rows and a half: rounds down
        engine = Engine.from_pretrained(None, kv_budget_mb=budget, max_batch_size=99, **OPTS)
        assert engine.run_options.max_batch_size == rows == engine.admitted_batch_size
        assert engine.options.max_batch_size == 99  # what the caller set stays as set
        assert engine.runner.kv_bytes <= budget * 2**20


def test_the_prefix_cache_comes_out_of_the_budget():
    one_row = Engine.from_pretrained(None, max_batch_size=1, **OPTS).runner.kv_bytes
    budget = 4 * one_row / 2**20
    engine = Engine.from_pretrained(None, kv_budget_mb=budget, prefix_cache_tokens=128, **OPTS)
    assert engine.runner.kv_bytes <= budget * 2**20 and engine.run_options.max_batch_size == 3


def test_segment_sparse_admits_more_rows_in_the_same_budget():
    budget = 8 * Engine.from_pretrained(None, max_batch_size=1, **OPTS).runner.kv_bytes / 2**20
    static = Engine.from_pretrained(None, kv_budget_mb=budget, **OPTS)
    sparse = Engine.from_pretrained(None, kv_budget_mb=budget, cache_policy="segment_sparse", **OPTS)
    assert static.admitted_batch_size == 8
    assert sparse.admitted_batch_size > static.admitted_batch_size
    assert sparse.runner.kv_bytes <= budget * 2**20


def test_a_budget_below_one_row_is_refused_with_the_sizes():
    with pytest.raises(ConfigError, match=r"one row of max_input_len \+ max_output_len needs 160 slots"):
        Engine.from_pretrained(None, kv_budget_mb=0.01, **OPTS)
