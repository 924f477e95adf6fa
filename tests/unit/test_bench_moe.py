"""The harness's mixture-of-experts workload: the built-in Qwen3-MoE has the stated shape (>= 8 experts,
top-2, 50-100 M parameters), its plan runs W1 only with the baseline against ours under the 2.5 target,
peak memory comes from a fresh process per side, and the results files carry the new fields. Tiny
models, no timing assertions."""

from __future__ import annotations

import json

import pytest
import torch

from flashx_batch.bench import __main__ as harness
from flashx_batch.bench import memory, report
from flashx_batch.bench.models import QWEN3_MOE_78M, moe_shape, parameter_count, random_qwen3_moe
from flashx_batch.bench.roofline import ModelCost
from flashx_batch.bench.workloads import QUICK, WorkloadSizes, build_all

SMALL = WorkloadSizes(rows=12, short=(4, 12), medium=(20, 40), long=(60, 80), output=(2, 8), equal_prompt=24,
                      equal_output=4, group_rows=16, groups=1, prefix=36, suffix=(4, 12), fewshot_output=(2, 4))
TINY = dict(QWEN3_MOE_78M, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, intermediate_size=96)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The harness's builder at a tiny width (same config keys, 8 experts, top-2)."""
    return random_qwen3_moe(TINY, out_dir=tmp_path_factory.mktemp("bench-moe") / "qwen3-moe")


def test_the_builtin_moe_is_a_top2_qwen3_moe_of_50_to_100m_parameters(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**QWEN3_MOE_78M)
    assert config.num_experts >= 8 and config.num_experts_per_tok == 2
    with torch.device("meta"):  # no weights allocated: the count only
        model = Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())  # the tied LM head counted once
    assert 50e6 <= total <= 100e6 and total == 77_757_696
    config.save_pretrained(tmp_path)
    shape = moe_shape(tmp_path)
    assert shape["experts"] == 8 and shape["top_k"] == 2 and shape["sparse_layers"] == 6
    assert shape["expert_parameters"] == 6 * 8 * 3 * 512 * 768
    assert shape["active_expert_parameters"] == shape["expert_parameters"] // 4
    # the roofline charges a token its top-2 experts' FLOPs, every expert's bytes
    cost = ModelCost.from_hf_dir(tmp_path, total)
    assert cost.flops_per_token == 2.0 * (total - shape["expert_parameters"] + shape["active_expert_parameters"])
    assert cost.weight_bytes == 4.0 * total


def test_the_builder_saves_a_seeded_safetensors_checkpoint(tiny_moe, tmp_path):
    cfg = json.loads((tiny_moe / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and (tiny_moe / "model.safetensors").is_file()
    again = random_qwen3_moe(TINY, out_dir=tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (tiny_moe / "model.safetensors").read_bytes()
    assert moe_shape(tiny_moe)["experts"] == 8 and parameter_count(tiny_moe) > 0


def test_moe_is_a_builtin_model_with_its_own_plan(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(harness, "random_qwen3_moe", lambda shape, out_dir: built.append(shape) or out_dir)
    planned = harness.resolve_models(["qwen3-moe", str(tmp_path / "some-model")], tmp_path)
    assert built == [QWEN3_MOE_78M]
    assert planned["qwen3-moe"] == (tmp_path / "qwen3-moe", harness.MOE_PLAN)
    assert planned["some-model"] == (tmp_path / "some-model", harness.FULL_PLAN)
    assert "qwen3-moe" in harness.BUILTIN_MODELS  # in the default run
    assert harness.MOE_PLAN.workloads == ("W1",) and harness.MOE_PLAN.targets == report.MOE_TARGETS


def test_the_moe_plan_gates_and_times_w1_against_the_2_5x_target(tiny_moe):
    s = harness.Settings(sizes=SMALL, batch_size=4, repeats=1, sweep_batch_sizes=(2, 4), sweep_repeats=1,
                         gate_rows=2, sweep_variants=harness.SWEEP_VARIANTS, threads=1, seed=0, quick=True)
    threads = torch.get_num_threads()
    try:
        result = harness.bench_model("qwen3-moe", tiny_moe, s, harness.MOE_PLAN)
    finally:
        torch.set_num_threads(threads)
    assert set(result.runs) == {"W1"} and set(result.runs["W1"]) == {"transformers_arrival", "ours_bucketed"}
    assert result.gate_checked["W1"] == {"ours_bucketed": 4}  # the sample before timing and on the timed run
    assert {p["batch_size"] for p in result.sweep} == {4}  # no sweep
    ratio = report.ratios("qwen3-moe", result.runs, result.plan.targets)
    assert ratio["qwen3-moe/W1/ours_bucketed_over_transformers_arrival"]["target"] == ">= 2.5"


def test_peak_memory_comes_from_a_fresh_process_per_side(tiny_moe):
    w1 = build_all(QUICK, 256)["W1"]
    figures = memory.measure(tiny_moe, ("ours_bucketed",), quick=True, batch_size=4,
                             max_input_len=harness._round_up(QUICK.max_prompt_len),
                             max_output_len=QUICK.max_output_len, threads=1, seed=0)
    m = figures["ours_bucketed"]
    assert "error" not in m, m
    assert m["output_tokens"] == w1.output_tokens
    assert 0 < m["baseline_rss_mib"] <= m["loaded_rss_mib"] and m["process_peak_rss_mib"] >= m["loaded_rss_mib"]
    assert m["run_peak_rss_mib"] >= m["loaded_rss_mib"] - 1  # reset to the current RSS, then the run's growth
    assert m["run_peak_over_baseline_mib"] == pytest.approx(m["run_peak_rss_mib"] - m["baseline_rss_mib"])
    broken = memory.measure(tiny_moe, ("no_such_variant",), quick=True, batch_size=4, max_input_len=16,
                            max_output_len=4, threads=1, seed=0)
    assert broken["no_such_variant"]["error"].startswith("exit status")


def test_results_files_carry_the_models_and_peak_memory(tmp_path):
    runs = {}
    for name, rate in (("transformers_arrival", 1.0), ("ours_bucketed", 2.6)):
        v = report.VariantRuns(name, 8, name.startswith("ours"))
        for _ in range(3):
            v.walls.append(10.0 / rate)
            v.output_tokens.append(100)
            v.total_tokens.append(400)
            v.latencies += [1.0 / rate]
        runs[name] = v
    peaks = {"transformers_arrival": {"variant": "transformers_arrival", "baseline_rss_mib": 500.0,
                                      "loaded_rss_mib": 800.0, "process_peak_rss_mib": 1200.0,
                                      "run_peak_rss_mib": 900.0, "run_peak_over_baseline_mib": 400.0},
             "ours_bucketed": {"error": "exit status 1: boom"}}
    models = {"m": {"path": "/x", "parameters": 77_757_696, "architecture": "Qwen3MoeForCausalLM",
                    "workloads": ["W1"], "variants": ["transformers_arrival", "ours_bucketed"],
                    "moe": {"experts": 8, "top_k": 2, "active_parameters": 35_290_368}}}
    doc = report.results_document({"m/W1": runs}, report.ratios("m", {"W1": runs}, report.MOE_TARGETS),
                                  {"threads": 1}, {"quick": True, "repeats": 3, "workloads": {}, "gate": "passed",
                                                   "models": models}, {"m": peaks})
    report.write(doc, [report.sweep_point("m", v) for v in runs.values()], tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    ratio = data["ratios"]["m/W1/ours_bucketed_over_transformers_arrival"]
    assert ratio["median"] == pytest.approx(2.6) and ratio["target"] == ">= 2.5" and ratio["met"] is True
    assert data["memory"]["m"]["transformers_arrival"]["run_peak_rss_mib"] == 900.0
    assert data["run"]["models"]["m"]["moe"]["experts"] == 8
    md = (tmp_path / "results.md").read_text()
    assert "| m | transformers_arrival | 900 | 400 | 800 | 1200 | 500 |" in md
    assert "| m | ours_bucketed | exit status 1: boom |" in md
    assert "| m | Qwen3MoeForCausalLM | 77,757,696 | 8 (top-2) | 35,290,368 | W1 |" in md


def test_the_upcycled_moe_keeps_the_bundled_models_predictions(tmp_path):
    """The trained mixture of experts the int8 benchmark measures on: the bundled model's MLP in 8 perturbed
    copies, top-2 routing. It loads as a Mixtral, our greedy tokens equal `transformers`', and it predicts
    the dense model's next token at most positions (trained weights, not noise)."""
    import transformers

    from flashx_batch import Engine, SamplingParams
    from flashx_batch.bench.models import upcycled_bundled_moe
    from flashx_batch.runtime.options import bundled_model_dir

    model_dir = upcycled_bundled_moe(tmp_path / "upcycled")
    assert moe_shape(model_dir)["experts"] == 8 and moe_shape(model_dir)["top_k"] == 2
    opts = dict(backend="cpu", dtype="float32", max_batch_size=2, max_input_len=64, max_output_len=8)
    ours, dense = Engine.from_pretrained(model_dir, **opts), Engine.from_pretrained(bundled_model_dir(), **opts)
    prompt = ours.tokenizer.encode("Permission is hereby granted, free of charge, to any person obtaining a copy")
    out = ours.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    hf = transformers.MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert list(out) == want
    a, b = ours.score([prompt])[0], dense.score([prompt])[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    assert not torch.allclose(a, b, atol=1e-3)  # the experts differ from the dense MLP: routing matters
