"""Loading: clear errors for missing files, unknown architectures and shape mismatches; sharded checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashx_batch import Engine, SamplingParams
from flashx_batch.errors import ModelLoadError
from flashx_batch.models.config import ModelConfig


def _copy(tiny_models, arch, tmp_path):
    dst = tmp_path / arch
    shutil.copytree(tiny_models[arch][0], dst)
    return dst


def _load(path):
    return Engine.from_pretrained(path, backend="cpu", dtype="float32", max_batch_size=2, max_input_len=32,
                                  max_output_len=8, segment_size=8)


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        _load(tmp_path)


def test_unknown_architecture_lists_the_supported_ones(tiny_models, tmp_path):
    path = _copy(tiny_models, "llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    supported = ("supported: DeepseekV3ForCausalLM, Glm4ForCausalLM, Glm4MoeForCausalLM, GlmForCausalLM, "
                 "GlmMoeDsaForCausalLM")
    with pytest.raises(ModelLoadError, match=f"GPT2LMHeadModel.*{supported}"):
        _load(path)


def test_shape_mismatch_names_file_and_tensor(tiny_models, tmp_path):
    path = _copy(tiny_models, "llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, path / "model.safetensors")
    where = r"model.safetensors:model.layers.1.mlp.down_proj.weight: shape \(64, 100\)"
    with pytest.raises(ModelLoadError, match=where):
        _load(path)


def test_missing_weights_and_tensors_are_errors(tiny_models, tmp_path):
    path = _copy(tiny_models, "qwen3", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.0.attn.q_norm.weight"):
        _load(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        _load(path)


def test_sharded_checkpoint_loads_identically(tiny_models, tmp_path):
    single = _load(tiny_models["glm"][0])
    path = _copy(tiny_models, "glm", tmp_path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert _load(path).generate([[5, 6, 7]], params)[0].token_ids == single.generate([[5, 6, 7]], params)[0].token_ids


def test_config_quirks_are_read_in_one_place(tiny_models):
    glm = ModelConfig.from_dir(tiny_models["glm"][0])
    assert glm.rope.interleaved and glm.rotary_dim == glm.head_dim // 2 and glm.attention_bias
    qwen2 = ModelConfig.from_dir(tiny_models["qwen2"][0])
    assert qwen2.attention_bias and qwen2.tie_word_embeddings
    llama = ModelConfig.from_dir(tiny_models["llama"][0])
    assert llama.rope.rope_type == "llama3" and llama.rope.factor == 8.0


def test_weights_are_fused_and_contiguous(tiny_models):
    model = _load(tiny_models["llama"][0]).runner.model
    attn = model.layers[0].attn
    assert attn.qkv.weight.shape == (64 + 2 * 32, 64) and attn.qkv.weight.is_contiguous()
    assert model.layers[0].mlp.gate_up.weight.shape == (256, 64)
    assert model.lm_head.weight is model.embed  # tied embeddings share one tensor
