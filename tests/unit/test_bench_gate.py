"""The throughput harness: the correctness gate catches a wrong variant; workloads are seeded and have the
stated mix; the written results follow the issue's schema. Tiny random model: a few seconds."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest
import torch

from flashx_batch.bench import __main__ as harness
from flashx_batch.bench import report
from flashx_batch.bench.gate import GateCheck, GateFailure
from flashx_batch.bench.roofline import Machine
from flashx_batch.bench.variants import RunResult, build_variants
from flashx_batch.bench.workloads import (
    MIN_GROUP_ROWS,
    MIN_SHARED_FRACTION,
    QUICK,
    WorkloadSizes,
    build_all,
    class_counts,
    shared_prefix_len,
)

SMALL = WorkloadSizes(rows=20, short=(4, 12), medium=(20, 40), long=(60, 80), output=(2, 8), equal_prompt=24,
                      equal_output=4, group_rows=16, groups=1, prefix=36, suffix=(4, 12), fewshot_output=(2, 4))


class WrongVariant:
    """Wraps a correct variant and flips one generated token of one row: what the gate must catch."""

    lossless = True
    gated = True

    def __init__(self, inner, row: int = 0) -> None:
        self.inner, self.row = inner, row
        self.name, self.batch_size = f"wrong({inner.name})", inner.batch_size

    def run(self, workload) -> RunResult:
        result = self.inner.run(workload)
        tokens = result.outputs[self.row]
        tokens[-1] = (tokens[-1] + 1) % 256
        return result


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from model_factory import build

    path = tmp_path_factory.mktemp("bench") / "llama"
    return path, build("llama", path)


@pytest.fixture(scope="module")
def small_variants(tiny_llama):
    path, hf = tiny_llama
    return build_variants(path, hf, batch_size=4, max_input_len=96, max_output_len=8, threads=1,
                          include=("transformers_arrival", "ours_unbucketed", "ours_bucketed")).by_name()


def test_gate_passes_ours_and_fails_a_wrong_variant(tiny_llama, small_variants):
    _, hf = tiny_llama
    workload = build_all(SMALL, vocab_size=256, seed=1)["W1"]
    gate = GateCheck.prepare(hf, workload, count=4)
    ours = [small_variants["ours_unbucketed"], small_variants["ours_bucketed"]]
    gate.before(ours)  # no raise: our lossless paths equal transformers greedy
    assert gate.checked == {"ours_unbucketed": 4, "ours_bucketed": 4}
    wrong = WrongVariant(small_variants["ours_bucketed"], row=0)
    with pytest.raises(GateFailure, match=r"wrong\(ours_bucketed\)"):
        gate.before([wrong])
    timed = small_variants["ours_bucketed"].run(workload)
    gate.after(small_variants["ours_bucketed"], timed)
    wrong_timed = WrongVariant(small_variants["ours_bucketed"], row=gate.rows[0])
    with pytest.raises(GateFailure):
        gate.after(wrong_timed, wrong_timed.run(workload))


def test_baseline_mismatch_is_logged_not_fatal(tiny_llama, small_variants, caplog):
    _, hf = tiny_llama
    workload = build_all(SMALL, vocab_size=256, seed=2)["W2"]
    gate = GateCheck.prepare(hf, workload, count=2)
    baseline = WrongVariant(small_variants["transformers_arrival"], row=0)
    baseline.gated = False
    gate.before([baseline])  # no raise
    assert "baseline differs" in caplog.text


def test_workloads_are_seeded_and_have_the_stated_mix():
    a, b, c = (build_all(QUICK, vocab_size=4096, seed=s) for s in (0, 0, 1))
    assert all(a[w].prompts == b[w].prompts and a[w].max_new_tokens == b[w].max_new_tokens for w in a)
    assert a["W1"].prompts != c["W1"].prompts
    w1 = a["W1"]
    counts = {label: w1.labels.count(label) for label in ("short", "medium", "long")}
    assert counts == class_counts(w1.rows) and counts == {"short": 5, "medium": 8, "long": 3}
    ranges = {"short": QUICK.short, "medium": QUICK.medium, "long": QUICK.long}
    assert all(ranges[lab][0] <= len(p) <= ranges[lab][1] for p, lab in zip(w1.prompts, w1.labels))
    assert len(set(w1.max_new_tokens)) > 3 and all(QUICK.output[0] <= n <= QUICK.output[1] for n in w1.max_new_tokens)
    assert w1.labels != sorted(w1.labels, key=["short", "medium", "long"].index)  # arrival order is mixed
    assert all(3 <= t < 4096 for p in w1.prompts for t in p)
    assert {len(p) for p in a["W2"].prompts} == {QUICK.equal_prompt} and len(set(a["W2"].max_new_tokens)) == 1
    w3 = a["W3"]
    for group in set(w3.labels):
        rows = [p for p, lab in zip(w3.prompts, w3.labels) if lab == group]
        assert len(rows) >= MIN_GROUP_ROWS
        assert all(shared_prefix_len(rows[0], p) / len(p) >= MIN_SHARED_FRACTION for p in rows)
    assert max(w3.max_new_tokens) <= QUICK.fewshot_output[1]
    assert class_counts(50) == {"short": 15, "medium": 25, "long": 10}


def test_results_follow_the_issue_schema(tmp_path):
    runs = {}
    for name, rate in (("transformers_arrival", 1.0), ("ours_unbucketed", 2.5), ("ours_bucketed", 3.0)):
        v = report.VariantRuns(name, 8, name.startswith("ours"))
        for _ in range(3):
            v.walls.append(10.0 / rate)
            v.output_tokens.append(100)
            v.total_tokens.append(400)
            v.latencies += [1.0 / rate, 2.0 / rate]
        runs[name] = v
    doc = report.results_document({"m/W1": runs}, report.ratios("m", {"W1": runs}), {"threads": 1},
                                  {"quick": True, "repeats": 3, "workloads": {}, "gate": "passed"})
    sweep = [report.sweep_point("m", v) for v in runs.values()]
    paths = report.write(doc, sweep, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    fields = {"output_tok_per_s", "total_tok_per_s", "p50_batch_latency_s", "p95_batch_latency_s",
              "padding_efficiency"}
    assert {"workloads", "ratios", "machine"} <= set(data)
    assert all(fields <= set(v) for v in data["workloads"]["m/W1"]["variants"].values())
    ratio = data["ratios"]["m/W1/ours_bucketed_over_transformers_arrival"]
    assert ratio["median"] == pytest.approx(3.0) and ratio["met"] is True
    assert not data["ratios"]["m/W1/ours_bucketed_over_ours_unbucketed"]["met"]  # 1.2 < 1.5
    assert {p.name for p in paths} >= {"results.json", "results.md", "throughput_vs_batch_size.png",
                                       "latency_vs_throughput.png"}


def test_harness_exits_nonzero_and_writes_no_results_when_the_gate_fails(tiny_llama, tmp_path, monkeypatch):
    path, _ = tiny_llama

    def failing(*args, **kwargs):
        from flashx_batch.bench.gate import Mismatch

        raise GateFailure([Mismatch("ours_bucketed", "W1", 0, 1, [5, 6], [5, 7])])

    monkeypatch.setattr(harness, "bench_model", failing)
    fake = Machine("cpu", 1, 1.0, 1.0, "float32", "test", torch.__version__, "3")
    monkeypatch.setattr(harness, "measure_machine", lambda device: fake)
    torch_threads = torch.get_num_threads()
    try:
        assert harness.main(["--out", str(tmp_path), "--quick", "--model", str(path)]) == 1
    finally:
        torch.set_num_threads(torch_threads)
    assert (tmp_path / "gate_failure.json").is_file() and not (tmp_path / "results.json").exists()


def test_gpu_protocol_runs_end_to_end_in_its_cpu_smoke_mode(tmp_path):
    """The GPU protocol has to work the first time a GPU is lent (device minutes are scarce): its
    --cpu-smoke mode runs every phase on a tiny shape and writes the JSON the README quotes."""
    from flashx_batch.bench import gpu_protocol

    assert gpu_protocol.main(["--out", str(tmp_path), "--cpu-smoke", "--repeats", "1"]) == 0
    result = json.loads((tmp_path / "gpu_protocol.json").read_text())
    w1 = result["W1"]
    assert w1["rows"] == gpu_protocol.SMOKE_W1.rows
    rates = w1["output_tok_per_s"]  # one repeat: the ratio is the two rates' quotient
    assert w1["ratio_ours_bucketed_over_transformers_arrival"]["median"] == pytest.approx(
        rates["ours_bucketed"]["median"] / rates["transformers_arrival"]["median"])
    assert w1["greedy_agreement_on_sample"]["ours_bucketed"] == 1.0  # float32 on CPU: token for token
    w2 = result["W2"]  # equal lengths: the seed article's static batch
    assert w2["rows"] == gpu_protocol.SMOKE_W1.rows and w2["greedy_agreement_on_sample"]["ours_bucketed"] == 1.0
    assert set(result["decode_steps"]) == {"1", "4", "8"} and not result["skipped"]
    for step in result["decode_steps"].values():
        assert step["ours_step_s"] > 0 and step["ours_eager_step_s"] > 0 and step["transformers_step_s"] > 0
        assert 0 < step["ours_fraction_of_bound"] == pytest.approx(step["bandwidth_bound_step_s"] / step["ours_step_s"])
        assert step["graphs_vs_eager_token_agreement"] == 1.0  # on CPU both engines step eagerly


def test_gpu_protocol_keeps_the_other_phases_when_one_fails(tmp_path, monkeypatch):
    """A phase that breaks on the GPU is logged and recorded, the next phase still runs, the JSON is
    written, and the exit status says so."""
    from flashx_batch.bench import gpu_protocol

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_protocol, "workload_comparison", broken)
    assert gpu_protocol.main(["--out", str(tmp_path), "--cpu-smoke", "--repeats", "1"]) == 1
    result = json.loads((tmp_path / "gpu_protocol.json").read_text())
    error = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert result["errors"] == {"W1": error, "W2": error}  # both comparisons broke, each recorded
    assert "W1" not in result and set(result["decode_steps"]) == {"1", "4", "8"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_protocol_refuses_to_start_without_a_gpu(tmp_path):
    from flashx_batch.bench import gpu_protocol

    assert gpu_protocol.main(["--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_paged_schedule_count_admits_rows_as_their_own_slots_free():
    """The README's schedule count: rows in order, each admitted once its own need fits; a row's
    first token comes from its prefill, so it decodes new_tokens - 1 steps."""
    from flashx_batch.bench.schedule_count import paged_decode_steps

    # rows 0 and 1 fill the 64 slots; row 1 leaves after 1 step and row 2 takes its place
    assert paged_decode_steps([32, 32, 32], [3, 2, 2], slots=64, max_rows=8) == 2
    assert paged_decode_steps([32, 32, 32], [3, 2, 2], slots=64, max_rows=1) == 4  # one row at a time
    assert paged_decode_steps([48, 16, 16], [3, 2, 2], slots=64, max_rows=8) == 2  # row 2 waits for row 1
    assert paged_decode_steps([16], [1], slots=64, max_rows=8) == 0  # done at its prefill
    with pytest.raises(ValueError, match="row 0 needs 100 slots"):
        paged_decode_steps([100], [5], slots=64, max_rows=8)


def test_peers_flag_hands_the_comparison_to_bench_peers(monkeypatch, tmp_path):
    """`python -m flashx_batch.bench --peers ...` runs `bench.peers` with the harness's model, threads,
    repeats and size; a peer that is not wired in, or a missing optional extra, is a clear refusal."""
    from flashx_batch.bench import peers

    seen = []
    monkeypatch.setattr(peers, "main", lambda argv: seen.append(argv) or 0)
    assert harness.main(["--out", str(tmp_path), "--peers", "ctranslate2", "--threads", "2", "--repeats", "5",
                         "--quick", "--model", "/models/x"]) == 0
    assert seen == [["--out", str(tmp_path / "peers"), "--peers", "ctranslate2", "--threads", "2",
                     "--model", "/models/x", "--quick", "--repeats", "5"]]
    assert harness.main(["--out", str(tmp_path), "--peers", "ctranslate2", "--model", "llama-27m"]) == 2
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="not wired in"):
        peers.main(["--out", str(tmp_path), "--peers", "vllm"])
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as on a machine without the extra: import fails
    with pytest.raises(SystemExit, match="pip install llama-cpp-python"):
        peers.main(["--out", str(tmp_path), "--peers", "llama_cpp"])
    monkeypatch.undo()
    monkeypatch.delenv("LLAMA_CPP_SOURCE", raising=False)
    if importlib.util.find_spec("llama_cpp") is not None:  # installed: the converter's source is asked for next
        with pytest.raises(SystemExit, match="LLAMA_CPP_SOURCE"):
            peers.main(["--out", str(tmp_path), "--peers", "llama_cpp"])


def test_shared_prefixes_find_w3_groups_and_fresh_prefixes_keep_the_rest():
    """W3's groups and their prefix are found from the prompts alone (never in W1 / W2); redrawn prefixes
    change every group's prefix, keep suffixes, output lengths and grouping, and differ by seed."""
    from flashx_batch.bench.roofline import ModelCost, floor_seconds

    work = build_all(SMALL, vocab_size=4096, seed=0)
    assert work["W1"].shared_prefixes() == [] and work["W2"].shared_prefixes() == []
    w3 = work["W3"]
    groups = w3.shared_prefixes()
    assert [rows for _, rows in groups] == [[i for i, lab in enumerate(w3.labels) if lab == g]
                                            for g in dict.fromkeys(w3.labels)]
    assert all(length >= SMALL.prefix for length, _ in groups)
    fresh, again, other = (w3.with_fresh_prefixes(s) for s in (0, 0, 1))
    assert fresh.prompts == again.prompts and fresh.prompts != other.prompts
    assert fresh.max_new_tokens == w3.max_new_tokens and fresh.labels == w3.labels
    for length, rows in groups:
        assert len({tuple(fresh.prompts[i][:length]) for i in rows}) == 1
        assert all(fresh.prompts[i][:length] != w3.prompts[i][:length] for i in rows)
        assert all(fresh.prompts[i][length:] == w3.prompts[i][length:] for i in rows)
    # the roofline counts a shared prefix once per group: W3's floor is below the same rows' without sharing
    cost = ModelCost(parameters=1000, flops_per_token=2000.0, weight_bytes=4000.0, kv_bytes_per_token=64.0)
    machine = Machine(device="cpu", threads=1, mem_bandwidth_gb_s=1e-6, matmul_gflop_s=1e-6, matmul_dtype="float32",
                      cpu="x", torch="x", python="x")
    unshared = dataclasses.replace(w3, labels=[str(i) for i in range(w3.rows)])
    assert unshared.shared_prefixes() == []
    shared_s, plain_s = (floor_seconds(w, 8, cost, machine)["compute_s"] for w in (w3, unshared))
    repeated = sum((len(rows) - 1) * length for length, rows in groups)
    assert plain_s - shared_s == pytest.approx(repeated * cost.flops_per_token / 1e3)
