"""compressed-tensors checkpoints: tiny random models written in the library's formats (its presets for the
config, its `pack_to_int32` for 4-bit values) load onto the right modules and compute what the formats
define. Weight-only schemes generate the greedy tokens `transformers` generates on the same weights
dequantized to float32; W8A8 (written by our own `quantize output.checkpoint=`) runs our int8 kernel with
the checkpoint's exact values and scales and stays close to that reference; schemes and tensors that do
not fit are refused naming them."""

from __future__ import annotations

import json

import pytest
import torch
from model_factory import build
from parity_support import cpu_engine, hf_greedy, prompts
from quantized_support import projections, quantized_checkpoint

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.loader import check_checkpoint
from flashx_batch.quant.checkpoint_linear import DequantizingLinear
from flashx_batch.quant.linear import QuantLinear
from flashx_batch.runtime.params import SamplingParams

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _int4(weight: torch.Tensor, group: int | None, sym: bool, actorder: bool, seed: int):
    """The pack-quantized tensors of one linear and its dequantized float32 weight."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, inp = weight.shape
    size = group or inp
    g_idx = torch.arange(inp) // size
    if actorder:
        g_idx = g_idx[torch.randperm(inp, generator=torch.Generator().manual_seed(seed))]
    groups = int(g_idx.max()) + 1
    scale, zero = torch.empty(out, groups), torch.zeros(out, groups, dtype=torch.int64)
    for g in range(groups):
        block = weight[:, g_idx == g]
        if sym:
            scale[:, g] = block.abs().amax(1).clamp(min=1e-8) / 7.5
        else:
            low, high = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scale[:, g] = ((high - low) / 15).clamp(min=1e-8)
            zero[:, g] = (torch.round(-low / scale[:, g]) - 8).clamp(-8, 7).long()
    scale = scale.to(torch.bfloat16)
    q = torch.round(weight / scale.float()[:, g_idx] + zero[:, g_idx]).clamp(-8, 7).long()
    dequantized = (q - zero[:, g_idx]).float() * scale.float()[:, g_idx]
    parts = {"weight_packed": pack_to_int32(q.to(torch.int8), 4), "weight_scale": scale,
             "weight_shape": torch.tensor([out, inp])}
    if not sym:
        parts["weight_zero_point"] = pack_to_int32(zero.to(torch.int8), 4, packed_dim=0)
    if actorder:
        parts["weight_g_idx"] = g_idx.to(torch.int32)
    return parts, dequantized


def _int8(weight: torch.Tensor):
    scale = (weight.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
    q = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def _fp8(weight: torch.Tensor, block: tuple[int, int] | None):
    from test_fp8_checkpoints import quantize_blocks

    if block is None:  # per channel
        scale = (weight.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
        q = (weight / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    q, scale, dequantized = quantize_blocks(weight, *block)
    return {"weight": q, "weight_scale": scale}, dequantized


def ct_checkpoint(arch: str, directory, scheme, fmt: str, quantize):
    """A random `arch` model saved in compressed-tensors `fmt` under config group `scheme` (a library
    QuantizationScheme targeting `Linear`), each projection quantized by `quantize(weight, index)`; returns
    transformers' model on the dequantized float32 weights."""
    from compressed_tensors.quantization import QuantizationConfig

    quant = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"])
    return quantized_checkpoint(arch, directory, projections(quantize, LINEARS), json.loads(quant.model_dump_json()))


def _scheme(preset: str, **weights):
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    return scheme.model_copy(update={"weights": scheme.weights.model_copy(update=weights)}) if weights else scheme


INT4_CASES = {"w4a16-sym-g16": (16, True, False), "w4a16-asym-g32-actorder": (32, False, True),
              "w4a16-sym-channel": (None, True, False)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(INT4_CASES))
def test_pack_quantized_int4_generates_transformers_tokens_on_the_dequantized_weights(tmp_path, one_thread, arch,
                                                                                     case):
    group, sym, actorder = INT4_CASES[case]
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel", "group_size": None}
    scheme = _scheme("W4A16" if sym else "W4A16_ASYM", **strategy)
    hf = ct_checkpoint(arch, tmp_path / "model", scheme, "pack-quantized",
                       lambda w, i: _int4(w, group, sym, actorder, i))
    check_checkpoint(tmp_path / "model")
    engine = cpu_engine(tmp_path / "model")
    for layer in engine.runner.model.layers:
        for linear in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            parts = list(linear.parts) if actorder and hasattr(linear, "parts") else [linear]
            assert all(isinstance(p, DequantizingLinear) and p.fmt == "int4" for p in parts)
    batch = prompts(5, (7, 18, 12))
    assert [o.token_ids for o in engine.generate(batch, GREEDY)] == [hf_greedy(hf, p, 12) for p in batch]


@pytest.mark.parametrize("block", [None, (16, 48)], ids=["per-channel", "blocks"])
def test_float8_weights_generate_transformers_tokens_on_the_dequantized_weights(tmp_path, one_thread, block):
    scheme = _scheme("FP8_BLOCK", block_structure=list(block)) if block else _scheme("FP8_DYNAMIC")
    hf = ct_checkpoint("qwen3", tmp_path / "model", scheme, "float-quantized", lambda w, i: _fp8(w, block))
    engine = cpu_engine(tmp_path / "model")
    assert sum(isinstance(m, DequantizingLinear) for m in engine.runner.model.modules()) == 4 * engine.config.num_layers
    batch = prompts(6, (9, 21))
    assert [o.token_ids for o in engine.generate(batch, GREEDY)] == [hf_greedy(hf, p, 12) for p in batch]


def test_weight_only_int8_generates_transformers_tokens_on_the_dequantized_weights(tmp_path, one_thread):
    scheme = _scheme("W8A16", strategy="channel", group_size=None)
    hf = ct_checkpoint("llama", tmp_path / "model", scheme, "int-quantized", lambda w, i: _int8(w))
    engine = cpu_engine(tmp_path / "model")
    kernels = {m.kernel for m in engine.runner.model.modules() if isinstance(m, QuantLinear)}
    assert kernels == {"dequant"}  # int8 values, activations kept in float32 (no int8_dynamic rounding)
    batch = prompts(7, (8, 16, 25))
    assert [o.token_ids for o in engine.generate(batch, GREEDY)] == [hf_greedy(hf, p, 12) for p in batch]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_our_w8a8_checkpoint_runs_its_exact_int8_values_on_the_int8_kernel(tmp_path, one_thread, arch):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    from flashx_batch.quant.w8a8_export import write_w8a8

    hf = build(arch, tmp_path / "float")
    counts = write_w8a8(tmp_path / "float", tmp_path / "w8a8")
    assert counts["quantized_linears"] == 7 * hf.config.num_hidden_layers
    config = json.loads((tmp_path / "w8a8" / "config.json").read_text())
    args = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"].weights
    written = load_file(str(tmp_path / "w8a8" / "model.safetensors"))
    engine = cpu_engine(tmp_path / "w8a8")
    layer = engine.runner.model.layers[1]
    assert layer.attn.qkv.kernel == "int8_dynamic" and layer.mlp.down.kernel == "int8_dynamic"
    base = "model.layers.1.self_attn."
    want = torch.cat([dequantize(written[base + f"{p}.weight"], written[base + f"{p}.weight_scale"], args=args)
                      for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(layer.attn.qkv.reference_weight(), want)  # the library's dequantization, value for value
    # against transformers on the dequantized weights: only activation rounding apart
    tokens = prompts(8, (20,))[0]
    ours = engine.score([tokens])[0]
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name + ".weight_scale" in written:
                module.weight.copy_(dequantize(written[name + ".weight"], written[name + ".weight_scale"], args=args))
        reference = hf(torch.tensor([tokens])).logits[0]
    assert ((ours - reference).norm() / reference.norm()).item() < 0.05


def test_refusals_name_the_tensor_or_the_scheme(tmp_path):
    from safetensors.torch import load_file, save_file

    ct_checkpoint("llama", tmp_path / "model", _scheme("W4A16"), "pack-quantized", lambda w, i: _int4(w, 128, True,
                                                                                                      False, i))
    path = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.mlp.up_proj.weight_scale"
    tensors[name] = tensors[name][:, :1].clone().repeat(1, 2)
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=rf"{name}: BF16 \[128, 2\], but model.layers.0.mlp.up_proj.weight_packed "
                                             r"\[128, 8\] \(compressed-tensors int4 per group 128: a \[128, 64\] "
                                             r"weight\) needs float \[128, 1\]"):
        check_checkpoint(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.down_proj.weight_packed: a int4 tensor, but quant"
                                             r"ization_config gives module model.layers.0.mlp.down_proj no scheme"):
        check_checkpoint(tmp_path / "model")


def test_settings_a_quantized_checkpoint_does_not_run_with_are_refused_before_loading(tmp_path):
    from flashx_batch.errors import ConfigError
    from flashx_batch.models.config import ModelConfig
    from flashx_batch.runtime.inputs import check_lora_options, check_options
    from flashx_batch.runtime.options import EngineOptions

    ct_checkpoint("llama", tmp_path / "model", _scheme("W8A16", strategy="channel", group_size=None), "int-quantized",
                  lambda w, i: _int8(w))
    cfg = ModelConfig.from_dir(tmp_path / "model")
    assert cfg.quantized == "compressed-tensors"
    with pytest.raises(ConfigError, match=r"pre-quantized checkpoint \(compressed-tensors\) does not combine with "
                                          r"runtime.precision_map with runtime.quantized_weights=keep"):
        check_options(EngineOptions(precision_map="map.json"), cfg)
    with pytest.raises(ConfigError, match=r"runtime.tensor_parallel_size=2 \(quantized weights are not split"):
        check_options(EngineOptions(tensor_parallel_size=2), cfg)
    with pytest.raises(ConfigError, match=r"model.lora_adapters does not combine with a pre-quantized checkpoint "
                                          r"\(compressed-tensors\) kept as stored"):
        check_lora_options(EngineOptions(), cfg)
    # dequantized at load, the model is all float linears: both apply
    check_options(EngineOptions(precision_map="map.json", quantized_weights="dequantize"), cfg)
    check_lora_options(EngineOptions(quantized_weights="dequantize"), cfg)


@pytest.mark.parametrize("groups, message", [
    ({"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                     "group_size": 32}},
      "group_1": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                         "group_size": 32, "symmetric": False}}},
     r"module model.layers.0.mlp.\w+_proj is matched by config groups of different schemes"),
    ({"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                     "group_size": 32},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
     r"float8 activations with int4 weights is not read"),
    ({"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor",
                                                     "symmetric": False}}},
     r"int4 weights per tensor with zero points is not read"),
])
def test_configs_that_cannot_be_read_exactly_are_refused(tmp_path, groups, message):
    ct_checkpoint("llama", tmp_path / "model", _scheme("W4A16", group_size=32), "pack-quantized",
                  lambda w, i: _int4(w, 32, True, False, i))
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["quantization_config"]["config_groups"] = groups
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        check_checkpoint(tmp_path / "model")


def test_group_indices_out_of_range_are_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    scheme = _scheme("W4A16", group_size=32)
    ct_checkpoint("llama", tmp_path / "model", scheme, "pack-quantized", lambda w, i: _int4(w, 32, True, True, i))
    path = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.self_attn.o_proj.weight_g_idx"
    tensors[name] = tensors[name].clone()
    tensors[name][5] = 99
    save_file(tensors, str(path))
    check_checkpoint(tmp_path / "model")  # values, not shapes: found when the weights are read
    with pytest.raises(ModelLoadError, match=rf"{name}: group indices 0..99, but the linear has 2 groups"):
        cpu_engine(tmp_path / "model")
