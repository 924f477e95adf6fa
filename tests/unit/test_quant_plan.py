"""Planner, precision-map round trip and refusal, load-time swap on a tiny random Llama."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from flashx_batch.models.loader import load_model
from flashx_batch.quant import PrecisionMapError, apply_precision_map, load_precision_map
from flashx_batch.quant.pipeline import PlanSettings, build_precision_map, summary_markdown
from flashx_batch.quant.planner import risk, solve
from flashx_batch.quant.precision_map import PrecisionMap
from flashx_batch.quant.sensitivity import Score, WindowScorer, bootstrap_ci
from flashx_batch.quant.units import FormatSwap, Unit, model_units, unit_bytes

BUDGET = 0.05


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tied 2-layer Llama (hidden 64, vocab 256) and windows of random tokens (calibration, held-out)."""
    from model_factory import build

    model_dir = tmp_path_factory.mktemp("quant") / "llama"
    build("llama", model_dir, seed=3)
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(3, 256, (24, 33), generator=gen).tolist()
    return model_dir, windows[:8], windows[8:]


def _load(model_dir):
    return load_model(model_dir, torch.float32, torch.device("cpu"), 64)


@pytest.fixture(scope="module")
def planned(tiny):
    model_dir, calib, held_out = tiny
    settings = PlanSettings(max_ppl_increase=BUDGET, bootstrap=300, batch_size=8)
    pmap = build_precision_map(_load(model_dir), model_dir, calib, held_out, settings)
    path = model_dir.parent / "map.json"
    pmap.save(path)
    return pmap, path


def test_solve_is_the_knapsack_optimum():
    """Against brute force on random sensitivities: min bytes with total risk within budget."""
    gen = torch.Generator().manual_seed(5)
    units = [Unit(f"u{i}", f"m{i}", 0, 16, 64, 0) for i in range(5)]
    formats = ["fp32", "int8", "int4"]
    sens = {u.name: {"fp32": Score(0.0, 0.0, 1.0), "int8": Score(float(torch.rand(1, generator=gen)) * 0.004, 0, 1),
                     "int4": Score(float(torch.rand(1, generator=gen)) * 0.02, 0, 1)} for u in units}
    cost = {u.name: {"fp32": 4096, "int8": 1100 + i, "int4": 600 + 3 * i} for i, u in enumerate(units)}
    budget = 0.02
    chosen = solve(units, sens, cost, budget, bins=4000)
    assert sum(risk(sens[u][f]) for u, f in chosen.items()) <= budget + 1e-12
    best = min(sum(cost[u.name][f] for u, f in zip(units, combo)) for combo in itertools.product(formats, repeat=5)
               if sum(risk(sens[u.name][f]) for u, f in zip(units, combo)) <= budget * (1 - 1 / 4000))
    assert sum(cost[u][f] for u, f in chosen.items()) <= best


def test_solve_with_no_budget_keeps_float_where_it_costs():
    units = [Unit("a", "a", 0, 16, 64, 0)]
    sens = {"a": {"fp32": Score(0, 0, 1), "int8": Score(1e-4, 0, 1)}}
    assert solve(units, sens, {"a": {"fp32": 10, "int8": 5}}, 0.0) == {"a": "fp32"}
    sens["a"]["int8"] = Score(-1e-3, 0, 1)  # measured as free: risk clamps at zero
    assert solve(units, sens, {"a": {"fp32": 10, "int8": 5}}, 0.0) == {"a": "int8"}


def test_bootstrap_interval_brackets_the_mean():
    deltas = [0.01 + 0.002 * math.sin(i) for i in range(40)]
    lo, hi = bootstrap_ci(deltas, 500, 0)
    point = math.exp(sum(deltas) / len(deltas)) - 1
    assert lo <= point <= hi and hi - lo < 0.01


def test_units_tile_every_fused_weight(tiny):
    model = _load(tiny[0])
    units = model_units(model)
    assert [u.kind for u in units[:7]] == ["q", "k", "v", "o", "gate", "up", "down"] and units[-1].name == "lm_head"
    for path in {u.module for u in units}:
        rows = sorted((u.start, u.stop) for u in units if u.module == path)
        assert rows[0][0] == 0 and rows[-1][1] == model.get_submodule(path).weight.shape[0]
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))


def test_cached_layer_scores_equal_a_full_forward(tiny):
    """Re-running from a cached layer input gives what a full forward with the same swap gives."""
    model = _load(tiny[0])
    units = model_units(model)
    scorer = WindowScorer(model, tiny[1][:4], batch_size=4)
    unit = units[10]  # layer 1 o_proj
    with FormatSwap(model, {unit.name: "int4"}, 64, units, simulate=True):
        partial = scorer.logits_from(0, unit.layer)
        full = scorer.logits_from(0, 0)
    assert torch.allclose(partial, full, atol=1e-5)


def test_planner_respects_budget_on_tiny_model(planned):
    pmap, _ = planned
    result, refs = pmap.data["result"], pmap.data["references"]
    assert result["passed"] and result["delta_ppl_ci95"][1] <= BUDGET
    assert result["delta_ppl_ci95"][0] <= result["delta_ppl"] <= result["delta_ppl_ci95"][1]
    assert result["weight_bytes"] <= refs["unquantized"]["weight_bytes"]
    assert result["kernels_vs_simulated"]["max_abs_logit_diff"] < 1e-3
    assert "| **planned** |" in summary_markdown(pmap)
    print(summary_markdown(pmap))


def test_map_lists_every_tensor_with_its_facts(planned, tiny):
    pmap, _ = planned
    model = _load(tiny[0])
    entries = {t["unit"]: t for t in pmap.data["tensors"]}
    assert set(entries) == {u.name for u in model_units(model)}
    for unit in model_units(model):
        t = entries[unit.name]
        assert t["tensor"] == unit.tensor and t["rows"] == [unit.start, unit.stop]
        assert t["bytes"] == unit_bytes(unit, t["format"], 64, torch.float32)
        assert {"int8", "int4", "bf16", "fp32"} <= set(t["sensitivity"]) and t["kernel"]
        assert (t["group_size"] is not None) == (t["format"] == "int4")
    assert {k["tensor"] for k in pmap.data["kept"]} >= {"embed", "norm.weight"}
    assert len(pmap.data["model"]["weights_sha256"]) == 64


def test_map_round_trip_and_apply(planned, tiny):
    pmap, path = planned
    loaded = load_precision_map(path)
    assert loaded.data == json.loads(json.dumps(pmap.data)) and loaded.assignment == pmap.assignment
    model = _load(tiny[0])
    embed_before = model.embed.detach().clone()
    scorer = WindowScorer(model, tiny[2][:2], batch_size=2, cache_layers=False)
    with FormatSwap(model, loaded.assignment, loaded.group_size, simulate=True):
        expected = scorer.logits_from(0, 0)
    summary = apply_precision_map(model, loaded, tiny[0])
    assert torch.equal(model.embed, embed_before)  # a tied lm_head never quantizes the embedding table
    assert sum(summary["formats"].values()) == len(model_units(model))
    assert torch.allclose(scorer.logits_from(0, 0), expected, atol=1e-3)


def test_quantized_tied_lm_head_leaves_embedding_alone(tiny):
    model = _load(tiny[0])
    assert model.lm_head.weight is model.embed
    before = model.embed.detach().clone()
    FormatSwap(model, {"lm_head": "int4"}, 64).originals.clear()
    assert torch.equal(model.embed, before) and model.lm_head.fmt == "int4"
    assert not any(p is model.embed for p in model.lm_head.parameters())


def test_map_for_other_weights_is_refused(planned, tiny, tmp_path):
    from model_factory import build

    _, path = planned
    other = tmp_path / "other"
    build("llama", other, seed=4)  # same shapes, different weights
    with pytest.raises(PrecisionMapError, match="sha256"):
        apply_precision_map(_load(other), load_precision_map(path), other)


def test_map_for_other_shapes_is_refused(planned, tmp_path):
    from model_factory import build

    _, path = planned
    other = tmp_path / "wide"
    build("llama", other, seed=3, intermediate_size=192)
    with pytest.raises(PrecisionMapError, match="intermediate_size: map 128, model 192"):
        apply_precision_map(_load(other), load_precision_map(path), other)


def test_bad_map_files_are_refused(planned, tmp_path):
    pmap, _ = planned
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PrecisionMapError, match="not valid JSON"):
        load_precision_map(bad)
    with pytest.raises(PrecisionMapError, match="no such file"):
        load_precision_map(tmp_path / "missing.json")
    future = PrecisionMap({**pmap.data, "version": 99})
    future.save(tmp_path / "future.json")
    with pytest.raises(PrecisionMapError, match="version 99"):
        load_precision_map(tmp_path / "future.json")


def test_replan_reuses_the_scan_at_a_tighter_budget(planned, tiny):
    from flashx_batch.quant.pipeline import reusable_scan

    pmap, path = planned
    model_dir, calib, held_out = tiny
    model = _load(model_dir)
    settings = PlanSettings(max_ppl_increase=0.01, bootstrap=300)
    scan = reusable_scan(load_precision_map(path), model, model_dir, settings)
    assert scan["lm_head"]["int4"].kl == pmap.data["tensors"][-1]["sensitivity"]["int4"]["kl"]
    tight = build_precision_map(model, model_dir, calib, held_out, settings, sensitivity=scan)
    result = tight.data["result"]
    assert not result["passed"] or result["delta_ppl_ci95"][1] <= 0.01
    with pytest.raises(PrecisionMapError, match="group size"):
        reusable_scan(load_precision_map(path), model, model_dir, PlanSettings(group_size=32))


def test_a_map_is_applied_once(planned, tiny):
    pmap, path = planned
    model = _load(tiny[0])
    apply_precision_map(model, load_precision_map(path), check_hash=False)
    if any(f != "fp32" for f in pmap.assignment.values()):
        with pytest.raises(ValueError, match="applied once"):
            apply_precision_map(model, load_precision_map(path), check_hash=False)


def test_engine_loads_a_map_through_its_options(planned, tiny):
    from flashx_batch import Engine, SamplingParams
    from flashx_batch.errors import ConfigError

    _, path = planned
    opts = dict(backend="cpu", dtype="float32", max_batch_size=2, max_input_len=32, max_output_len=8, segment_size=8)
    plain = Engine.from_pretrained(tiny[0], **opts)
    quant = Engine.from_pretrained(tiny[0], precision_map=str(path), **opts)
    assert type(quant.runner.model.layers[0].attn.qkv) is not type(plain.runner.model.layers[0].attn.qkv)
    out = quant.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert out.num_generated_tokens == 8
    with pytest.raises(ConfigError, match="onnx"):
        Engine.from_pretrained(tiny[0], precision_map=str(path), **{**opts, "backend": "onnx"})


def test_all_int8_rotates_the_down_projections_inputs_only(tiny):
    """int8 with int8 activations (a float32 CPU model): the gated MLP's down projection, whose input
    is a product with heavy tails, rounds it in the rotated basis; no other projection does."""
    model = _load(tiny[0])
    FormatSwap(model, {u.name: "int8" for u in model_units(model)}, 64).originals.clear()
    rotated = {name for name, m in model.named_modules() if getattr(m, "rotated", False)}
    assert rotated == {f"layers.{i}.mlp.down" for i in range(model.config.num_layers)}
