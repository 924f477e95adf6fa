"""The GPU check's summary: figures read from what the parts left, null (and named missing) where a part did not
run, the float32 parity flag from the device tests' log."""

import json

from flashx_batch.bench.gpu_summary import main, summarize


def test_the_summary_reads_each_part_and_names_what_is_missing(tmp_path):
    protocol = {"machine": {"device": "NVIDIA H200"},
                "W1": {"ratio_ours_bucketed_over_transformers_arrival": {"median": 8.1, "min": 7.9, "max": 8.4}},
                "W2": {"batch_size": 64, "output_tok_per_s": {"ours_bucketed": {"median": 61000.0}}},
                "decode_steps": {"1": {"ours_fraction_of_bound": 0.62}, "256": {"ours_fraction_of_bound": 0.51}}}
    (tmp_path / "gpu_protocol.json").write_text(json.dumps(protocol))
    (tmp_path / "device_tests.txt").write_text(
        "PASSED tests/device/test_cuda.py::test_float32_on_gpu_matches_cpu\n"
        "PASSED tests/device/test_cuda.py::test_decode_steps_from_cuda_graphs_give_the_eager_tokens[static]\n"
        "FAILED tests/device/test_cuda.py::test_decode_steps_from_cuda_graphs_give_the_eager_tokens[sparse]\n")
    summary = summarize(tmp_path)
    assert summary["device"] == "NVIDIA H200" and summary["w1_ratio_vs_transformers"] == 8.1
    assert summary["decode_b1_fraction_of_bound"] == 0.62 and summary["decode_b256_fraction_of_bound"] == 0.51
    assert summary["w2_output_tok_s"] == 61000.0 and summary["w2_batch_size"] == 64
    assert summary["tokens_match_cpu_float32"] is True and summary["graph_tokens_match_eager"] is False
    assert summary["kv_sparse_ratio_fixed_budget"] is None and summary["missing"] == ["kv_sparse"]
    assert main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["w1_ratio_vs_transformers"] == 8.1


def test_an_empty_directory_gives_nulls_not_figures(tmp_path):
    summary = summarize(tmp_path)
    assert summary["missing"] == ["device tests", "gpu protocol", "kv_sparse"]
    figures = [k for k in summary if k not in ("commit", "date", "missing", "errors")]
    assert all(summary[k] is None for k in figures)
