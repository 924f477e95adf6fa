"""int8 experts: a mixture-of-experts layer's stacked weights in our int8 format (`quant.int8_experts`), through
precision-map units, the load-time swap and the planner."""

from __future__ import annotations

import pytest
import torch

from flashx_batch.errors import ConfigError
from flashx_batch.models.loader import load_model
from flashx_batch.models.moe import SparseMoE
from flashx_batch.quant import apply_precision_map, load_precision_map
from flashx_batch.quant.int8_experts import Int8Experts
from flashx_batch.quant.precision_map import loaded_summary
from flashx_batch.quant.units import FormatSwap, available_formats, kept_tensors, model_units

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def glm_moe(tmp_path_factory):
    """GLM-4.5's shape in small: a dense first layer, then sigmoid-routed experts with a shared expert."""
    from model_factory import build

    model_dir = tmp_path_factory.mktemp("int8_experts") / "glm4_moe"
    build("glm4_moe", model_dir, seed=5)
    return model_dir


def _load(model_dir):
    return load_model(model_dir, torch.float32, torch.device("cpu"), 64)


def _random_moe(experts=16, top_k=4, intermediate=64, hidden=128, seed=0) -> SparseMoE:
    from flashx_batch.models.config import MoESpec

    torch.manual_seed(seed)
    spec = MoESpec(num_experts=experts, top_k=top_k, intermediate=intermediate, norm_topk_prob=True,
                   sparse_layers=(True,))
    moe = SparseMoE(spec, hidden, torch.float32, torch.device("cpu"))
    for p in moe.parameters():
        p.data.normal_(std=0.1)
    return moe


def test_units_cover_the_stacked_experts_and_the_shared_expert(glm_moe):
    model = _load(glm_moe)
    units = {u.name: u for u in model_units(model)}
    layers = model.config.num_layers
    assert "layers.0.mlp.gate" in units and "layers.0.mlp.experts_gate_up" not in units  # the dense first layer
    for i in range(1, layers):
        gate_up, down = units[f"layers.{i}.mlp.experts_gate_up"], units[f"layers.{i}.mlp.experts_down"]
        moe = model.layers[i].mlp
        assert gate_up.params == moe.experts_gate_up.numel() and down.params == moe.experts_down.numel()
        assert {f"layers.{i}.mlp.shared.{k}" for k in ("gate", "up", "down")} <= set(units)
        assert available_formats(gate_up, ["int4", "int8", "bf16"], 64) == ["int8"]
    # every unit names a real tensor, so the kept tensors are exactly the rest (norms, routers, embedding)
    params = dict(model.named_parameters())
    assert all(u.tensor in params for u in units.values())
    kept = kept_tensors(model)
    assert not any("experts_" in name for name in kept) and any(name.endswith(".router") for name in kept)


def test_the_decode_walk_and_the_per_expert_matmuls_give_the_same_bits(monkeypatch):
    """A decode step's compiled walk and a prefill's `_int_mm` per expert: exact int32 sums scaled in one order,
    so every row's outputs are equal bit for bit; both within int8's rounding of the float layer."""
    moe = _random_moe()
    x = torch.randn(8, 128)
    want = moe.forward(x)
    for which, rotate in (("gate_up", False), ("down", True)):
        moe.quantized[which] = Int8Experts.from_float(getattr(moe, f"experts_{which}").data, torch.float32,
                                                      rotate_input=rotate)
    assert moe.quantized["down"].rotated and not moe.quantized["gate_up"].rotated
    from flashx_batch.backends import cpu_moe
    from flashx_batch.quant import int8_experts

    walks = []
    real_walk = cpu_moe.int8_expert_rows
    monkeypatch.setattr(cpu_moe, "int8_expert_rows", lambda *a: walks.append(1) or real_walk(*a))
    monkeypatch.setattr(int8_experts, "WALK_MIN_EXPERTS", 1)  # the walk, whatever the expert count
    walked = moe.forward(x)
    assert len(walks) == 2  # both projections asked the walk
    monkeypatch.setattr(int8_experts, "WALK_MIN_EXPERTS", 10**6)  # few experts: `_int_mm` per active expert
    looped = moe.forward(x)
    assert len(walks) == 2
    assert torch.equal(walked, looped)
    error = ((walked - want).norm() / want.norm()).item()
    assert 0 < error < 0.05


def test_reference_weight_is_what_the_kernel_computes_with():
    weight = torch.randn(4, 32, 48)
    experts = Int8Experts.from_float(weight, torch.float32, rotate_input=True)
    ref = experts.reference_weight()
    assert ref.shape == weight.shape and (ref - weight).abs().max() <= weight.abs().amax() / 127 + 1e-6
    rows = torch.randn(6, 48)
    sorted_experts = torch.tensor([0, 0, 1, 3, 3, 3])
    counts = torch.bincount(sorted_experts, minlength=4)
    got = experts.sorted_rows(rows, sorted_experts, counts)
    exact = torch.stack([ref[e] @ r for r, e in zip(rows, sorted_experts.tolist())])
    assert torch.allclose(got, exact, rtol=0.03, atol=0.03 * exact.abs().max().item())  # activation rounding only


def test_int8_mlps_run_close_to_float_and_restore(glm_moe):
    from flashx_batch import Engine, SamplingParams

    engine = Engine.from_pretrained(glm_moe, backend="cpu", dtype="float32", max_batch_size=4, max_input_len=32,
                                    max_output_len=8, segment_size=8)
    model = engine.runner.model
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    before = [o.token_ids for o in engine.generate(prompts, params)]
    logits = engine.score(prompts)
    mlp_units = [u.name for u in model_units(model) if ".mlp." in u.name]  # experts, shared expert, dense MLP
    with FormatSwap(model, dict.fromkeys(mlp_units, "int8"), 64):
        summary = loaded_summary(model)
        assert summary["formats"] == {"int8": len(mlp_units), "fp32": len(model_units(model)) - len(mlp_units)}
        moe = model.layers[1].mlp
        assert set(moe.quantized) == {"gate_up", "down"} and moe.experts_gate_up.numel() == 0
        quantized = engine.score(prompts)
        for a, b in zip(logits, quantized):
            assert 0 < ((a - b).norm() / a.norm()).item() < 0.05
        assert all(len(o.token_ids) == 8 for o in engine.generate(prompts, params))
    assert [o.token_ids for o in engine.generate(prompts, params)] == before  # the float experts are back


def test_experts_take_int8_or_their_own_format_only(glm_moe):
    model = _load(glm_moe)
    before = model.layers[1].mlp.experts_gate_up.clone()
    with pytest.raises(ConfigError, match="int8 or the model's own fp32, not int4"):  # after gate / up was swapped
        FormatSwap(model, {"layers.1.mlp.experts_gate_up": "int8", "layers.1.mlp.experts_down": "int4"}, 64)
    moe = model.layers[1].mlp
    assert not len(moe.quantized) and torch.equal(moe.experts_gate_up, before)  # nothing left half swapped
    FormatSwap(model, {"layers.1.mlp.experts_down": "int8"}, 64).originals.clear()
    with pytest.raises(ValueError, match="applied once"):
        FormatSwap(model, {"layers.1.mlp.experts_down": "int8"}, 64)


def test_a_planned_map_quantizes_experts_through_the_engine(glm_moe, tmp_path):
    """The user's path: `python -m flashx_batch.quantize`'s pipeline plans a map over the experts' units, and an
    engine started with `precision_map=` applies it."""
    from flashx_batch import Engine, SamplingParams
    from flashx_batch.quant.pipeline import PlanSettings, build_precision_map

    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(3, 256, (16, 33), generator=gen).tolist()
    settings = PlanSettings(max_ppl_increase=0.5, bootstrap=100, batch_size=8, formats=["int8"])
    pmap = build_precision_map(_load(glm_moe), glm_moe, windows[:8], windows[8:], settings)
    path = tmp_path / "map.json"
    pmap.save(path)
    assigned = pmap.assignment
    assert {"layers.1.mlp.experts_gate_up", "layers.2.mlp.experts_down"} <= set(assigned)
    assert any(fmt == "int8" for name, fmt in assigned.items() if "experts_" in name)  # a generous budget
    kernels = {t["unit"]: t.get("kernel") for t in pmap.data["tensors"]}
    assert all(kernels[name] == Int8Experts.from_float(torch.zeros(1, 16, 16), torch.float32).kernel
               for name, fmt in assigned.items() if "experts_" in name and fmt == "int8")  # the kernel recorded
    engine = Engine.from_pretrained(glm_moe, backend="cpu", dtype="float32", max_batch_size=2, max_input_len=32,
                                    max_output_len=8, segment_size=8, precision_map=str(path))
    quantized = {name for name, fmt in assigned.items() if "experts_" in name and fmt == "int8"}
    held = {f"layers.{i}.mlp.experts_{w}" for i, layer in enumerate(engine.runner.model.layers)
            if isinstance(layer.mlp, SparseMoE) for w in layer.mlp.quantized}
    assert held == quantized
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert out.num_generated_tokens == 6
    model = _load(glm_moe)
    apply_precision_map(model, load_precision_map(path), check_hash=False)
    assert loaded_summary(model)["formats"].get("int8", 0) == sum(f == "int8" for f in assigned.values())


def test_latent_attention_models_are_still_refused_a_map(tmp_path):
    from model_factory import build

    from flashx_batch.backends import get_backend
    from flashx_batch.models.config import ModelConfig
    from flashx_batch.runtime.inputs import check_options
    from flashx_batch.runtime.options import EngineOptions

    build("deepseek_v3", tmp_path / "dsv3", seed=1)
    cfg = ModelConfig.from_dir(tmp_path / "dsv3")
    with pytest.raises(ConfigError, match="latent attention's projections"):
        check_options(EngineOptions(backend="cpu", precision_map="map.json"), cfg, get_backend("cpu"))
    with pytest.raises(ConfigError, match="latent attention's"):
        model_units(_load(tmp_path / "dsv3"))


@pytest.mark.parametrize("width", [48, 1024, 2304])
def test_the_walk_sums_exactly_at_any_width(width):
    """The compiled walk adds int8 products in float32 spans; at full scale (every code ±127, one sign: the
    largest sums there are) its sums still equal exact integer arithmetic, past one span's width too."""
    from flashx_batch.backends import cpu_moe

    if cpu_moe.kernel() is None:
        pytest.skip("numba is not available: the walk is not used")
    gen = torch.Generator().manual_seed(width)
    q = torch.randint(-127, 128, (3, 40, width), generator=gen, dtype=torch.int8)
    q[1] = 127  # expert 1: every product at its largest
    codes = torch.randint(-127, 128, (5, width), generator=gen, dtype=torch.int8)
    codes[2:4] = 127
    experts = torch.tensor([0, 1, 1, 1, 2])
    got = cpu_moe.int8_expert_rows(codes, experts, q)
    want = torch.stack([q[e].long() @ c.long() for c, e in zip(codes, experts.tolist())])
    assert torch.equal(got.long(), want)
    assert want.abs().max() == 127 * 127 * width
