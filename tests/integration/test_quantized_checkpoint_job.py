"""A job on a pre-quantized checkpoint: the bundled model written as W8A8 (`quantize output.checkpoint=`) runs
`conf=legal_docs` end to end on our int8 kernel, job.json records its precision (format, scheme, whether the
weights are kept), and a resume that would run them another way is refused before it touches the output."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from flashx_batch import run_job
from flashx_batch.runtime.options import bundled_model_dir


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    from flashx_batch.quant.w8a8_export import write_w8a8

    out = tmp_path_factory.mktemp("w8a8") / "model"
    write_w8a8(bundled_model_dir(), out)
    return out


def test_a_w8a8_job_records_its_precision_and_refuses_a_resume_that_runs_it_otherwise(tmp_path, w8a8):
    out = tmp_path / "out"
    args = ["conf=legal_docs", f"model.path={w8a8}", f"output.dir={out}", "executor.kind=local", "data.limit=6",
            "sampling.max_new_tokens=8"]
    assert run_job(args) == 0
    generated, errors = pq.read_table(out / "generations"), pq.read_table(out / "errors")
    assert generated.num_rows + errors.num_rows == 6 and generated.num_rows >= 4  # the sample holds over-long rows
    record = json.loads((out / "job.json").read_text())["fingerprint"]["model.quantization"]
    assert record["format"] == "compressed-tensors" and record["weights"] == "keep"
    assert record["scheme"] == ["int8 per channel, int8 activations per token"]
    assert run_job([*args, "runtime.quantized_weights=dequantize"]) == 2
    assert run_job(args) == 0  # the same settings resume (nothing left to do)
