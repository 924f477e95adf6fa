"""FP8 block-wise checkpoints (DeepSeek-V3 / Qwen3 / GLM-4.5 FP8 releases): tiny random DeepSeek-V3 and Qwen3 models
quantized to float8_e4m3fn with one scale per block (blocks that do and do not divide the weights' shapes) load
and generate the greedy tokens `transformers` generates on the same weights dequantized to float32; a scale of the
wrong shape, a missing scale and schemes this loader does not read are refused, naming the tensor or the scheme."""

from __future__ import annotations

import json

import pytest
import torch
from model_factory import build
from parity_support import cpu_engine, hf_greedy, prompts
from quantized_support import quantized_checkpoint

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.loader import check_checkpoint
from flashx_batch.quant.checkpoint_linear import DequantizingLinear

FP8_MAX = 448.0  # the largest float8_e4m3fn value


def _quantized(name: str, weight: torch.Tensor) -> bool:
    """What FP8 releases quantize: the layers' 2-D projection and expert weights (not norms, routers, embeddings,
    the LM head)."""
    return (weight.dim() == 2 and name.startswith("model.layers.") and name.endswith(".weight")
            and not name.endswith(("mlp.gate.weight", "norm.weight")))


def quantize_blocks(weight: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, its scale_inv per block, the dequantized float32 weight) as FP8 releases define them."""
    out, inp = weight.shape
    scale = torch.empty(-(-out // rows), -(-inp // cols))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            scale[i, j] = block.abs().max().clamp(min=1e-12) / FP8_MAX
    expanded = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    q = (weight / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


def fp8_checkpoint(arch: str, directory, rows: int, cols: int):
    """A random `arch` model saved as an FP8 block-wise checkpoint in `directory`; returns transformers' model
    loaded from the same weights dequantized to float32 (the reference; saved beside it in float32), and how
    many tensors were quantized."""
    quantized = []

    def quantize(name: str, weight: torch.Tensor, index: int):
        if not _quantized(name, weight):
            return None
        q, scale, dequantized = quantize_blocks(weight, rows, cols)
        quantized.append(name)
        return {name: q, name + "_scale_inv": scale}, dequantized

    hf = quantized_checkpoint(arch, directory, quantize, {"quant_method": "fp8", "fmt": "e4m3",
                                                          "activation_scheme": "dynamic",
                                                          "weight_block_size": [rows, cols]})
    return hf, len(quantized)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3"])
@pytest.mark.parametrize("blocks", [(16, 16), (128, 128), (48, 24)], ids=["divides", "larger", "does-not-divide"])
def test_fp8_blocks_generate_transformers_tokens_on_the_dequantized_weights(tmp_path, one_thread, arch, blocks):
    hf, quantized = fp8_checkpoint(arch, tmp_path, *blocks)
    assert quantized >= 8
    check_checkpoint(tmp_path)
    engine = cpu_engine(tmp_path)
    kept = [m for m in engine.runner.model.modules() if isinstance(m, DequantizingLinear)]
    # kept as FP8 (dense linears; latent attention's q_a / q_b / kv_a / o): experts and kv_b are dequantized
    assert len(kept) >= 4 and all(m.q.dtype == torch.float8_e4m3fn for m in kept)
    batch = prompts(3, (5, 17, 9, 30))
    got = [o.token_ids for o in engine.generate(batch, _greedy(12))]
    assert got == [hf_greedy(hf, p, 12) for p in batch]


def _greedy(n: int):
    from flashx_batch.runtime.params import SamplingParams

    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_a_bad_fp8_checkpoint_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_checkpoint("qwen3", tmp_path, 16, 16)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name + "_scale_inv"] = torch.ones(3, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"{name}_scale_inv: shape \[3, 3\] F32, but {name} \[128, 64\] in 16x16 "
                                             r"blocks needs float scales \[8, 4\]"):
        check_checkpoint(tmp_path)
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"{name}: an FP8 weight \[128, 64\] without its {name}_scale_inv"):
        check_checkpoint(tmp_path)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"gptq with bits=8 \(int4 only\)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version=gemv"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method=bitsandbytes\) this runtime does not read"),
    ({"quant_method": "compressed-tensors"}, "not a valid compressed-tensors config: config_groups: Field required"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}},
     r"config group group_0 \(nvfp4-pack-quantized\): float4 weights is not read"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}},
     r"int8 activations \(tensor, static, symmetric\) with int8 weights"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt=e5m2"),
    ({"quant_method": "fp8"}, "weight_block_size=None"),
])
def test_schemes_this_loader_does_not_read_are_refused(tmp_path, quantization, message):
    build("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelLoadError, match=message):
        check_checkpoint(tmp_path)
    with pytest.raises(ModelLoadError, match="supported: fp8 block-wise"):
        cpu_engine(tmp_path)
