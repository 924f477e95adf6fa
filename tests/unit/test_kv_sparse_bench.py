"""The KV-budget benchmark's workload: row counts that do not favour segment_sparse, and enough prompts."""

import pytest

from flashx_batch.bench.kv_sparse import default_rows, free_compression_ceiling, prompt_windows
from flashx_batch.quality.heldout import token_windows
from flashx_batch.runtime.options import bundled_model_dir
from flashx_batch.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(bundled_model_dir())


@pytest.mark.parametrize("static, sparse", [(8, 14), (8, 12), (32, 49), (16, 25), (7, 7), (3, 50)])
def test_default_rows_run_whole_static_batches(static, sparse):
    rows = default_rows(static, sparse)
    assert rows % static == 0  # static never pays for a part-empty batch
    assert rows >= sparse
    if rows % sparse:  # only where whole batches on both sides would take too many rows
        assert rows >= 4 * sparse and rows - static < 4 * sparse


def test_overlapping_windows_step_by_the_stride(tokenizer):
    plain = token_windows(tokenizer, 64, 3)
    half = token_windows(tokenizer, 64, 5, stride=32)
    assert half[0] == plain[0] and half[2] == plain[1]
    assert half[1] == plain[0][32:] + plain[1][:32]
    with pytest.raises(ValueError, match="stride"):
        token_windows(tokenizer, 64, 3, stride=65)


def test_prompt_windows_overlap_only_when_the_split_runs_short(tokenizer):
    few, stride = prompt_windows(tokenizer, 512, 8)
    assert stride == 512 and len(few) == 8
    available = len(token_windows(tokenizer, 512, 10_000))
    many, stride = prompt_windows(tokenizer, 512, available + 1)
    assert stride < 512 and len(many) == available + 1
    assert len({tuple(p) for p in many}) == len(many)


def test_free_compression_ceiling_keeps_static_prefill_and_sparse_decode():
    phases = {"static": {"prefill_s": [1.0, 9.0, 1.2], "decode_s": [1.2, 1.3, 0.1]},
              "segment_sparse": {"prefill_s": [5.0, 5.0, 5.0], "decode_s": [0.8, 0.9, 0.7]}}
    # medians: static 1.2 + 1.2; segment_sparse's decode 0.8; its prefill does not enter
    assert free_compression_ceiling(phases) == pytest.approx(2.4 / 2.0)
