"""Embeddings equal to `transformers`' own final hidden states pooled the same way: tiny random Qwen3 and
Llama models, last / mean / cls pooling, mixed lengths in one pack, Matryoshka truncation before the
normalisation; a sentence-transformers checkpoint's own head is read (pooling, Dense layers, Normalize) and one this
runtime cannot compute is refused when embedding."""

from __future__ import annotations

import json

import pytest
import torch
from model_factory import build

from flashx_batch import Engine
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.checkpoint_pooling import CheckpointPooling, UnsupportedPooling, checkpoint_pooling
from flashx_batch.runtime.params import SamplingParams
from flashx_batch.runtime.pooling import PoolingConfig

LENGTHS = (5, 31, 12, 1, 24, 9)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, directory)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in LENGTHS]
    return directory, hf, prompts


def _reference(hf, prompts, pooling: str) -> torch.Tensor:
    """transformers' final-norm hidden states (its base model's last_hidden_state), one prompt at a time."""
    out = []
    with torch.no_grad():
        for p in prompts:
            h = hf.model(torch.tensor([p])).last_hidden_state[0].float()
            out.append({"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling])
    return torch.stack(out)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_transformers(model, pooling):
    directory, hf, prompts = model
    engine = Engine.from_pretrained(directory, max_batch_size=4, max_input_len=64, max_output_len=8)
    got = engine.embed(prompts, pooling=pooling, normalize=False)
    want = _reference(hf, prompts, pooling)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert got.shape == want.shape and cosine.min().item() >= 0.99999
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # Matryoshka: the first D components, then unit length
    small = engine.embed(prompts, pooling=pooling, dimensions=16)
    expect = torch.nn.functional.normalize(want[:, :16], dim=-1)
    assert small.shape == (len(prompts), 16) and torch.allclose(small, expect, atol=1e-4)
    assert torch.allclose(small.norm(dim=-1), torch.ones(len(prompts)), atol=1e-5)


def test_small_packs_give_the_same_vectors(model):
    """Packs of one row each (a pack budget smaller than any prompt) against one pack of all."""
    from flashx_batch.runtime.pooling import Pooler

    directory, _, prompts = model
    engine = Engine.from_pretrained(directory, max_batch_size=4, max_input_len=64, max_output_len=8)
    config = PoolingConfig("mean", True)
    together = Pooler(engine.runner.scorer, 10_000).embed(prompts, config)
    alone = Pooler(engine.runner.scorer, 1).embed(prompts, config)
    assert torch.allclose(together, alone, atol=1e-5)


def test_models_that_cannot_pack_rows_pad_them_to_the_same_vectors(model):
    """Where the attention cannot pack rows (sliding windows), rows are right-padded: the same vectors."""
    from flashx_batch.runtime.pooling import Pooler

    directory, _, prompts = model
    engine = Engine.from_pretrained(directory, max_batch_size=4, max_input_len=64, max_output_len=8)
    scorer = engine.runner.scorer
    assert scorer.packs_rows
    packed = Pooler(scorer, 10_000).embed(prompts, PoolingConfig("last", False))
    scorer.packs_rows = False
    try:
        padded = Pooler(scorer, 10_000).embed(prompts, PoolingConfig("last", False))
    finally:
        scorer.packs_rows = True
    assert torch.allclose(packed, padded, atol=1e-4)


def test_a_long_prompt_keeps_its_head(model):
    """long_input=truncate keeps a pooled prompt's first max_input_len tokens (its instruction and first token),
    where generation keeps the tail."""
    directory, _, prompts = model
    engine = Engine.from_pretrained(directory, max_batch_size=4, max_input_len=16, max_output_len=8,
                                    long_input="truncate")
    long = prompts[1]  # 31 tokens
    got = engine.embed([long], pooling="cls", normalize=False)
    assert torch.allclose(got, engine.embed([long[:16]], pooling="cls", normalize=False), atol=1e-5)
    assert torch.allclose(engine.embed([long], pooling="mean"), engine.embed([long[:16]], pooling="mean"), atol=1e-5)


def test_the_checkpoints_own_pooling_is_read(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_lasttoken": False}))
    assert checkpoint_pooling(tmp_path) == CheckpointPooling("mean", True)
    assert checkpoint_pooling(tmp_path / "1_Pooling") is None


def _sentence_transformers_layout(directory, pooling: dict, dense: list[tuple[str, torch.nn.Linear]] = (),
                                  extra: list[dict] = ()) -> None:
    """modules.json, 1_Pooling and `dense` layers (activation name, layer) as sentence-transformers saves them."""
    from safetensors.torch import save_file

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    for i, (activation, layer) in enumerate(dense, start=2):
        path = directory / f"{i}_Dense"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps({"in_features": layer.in_features, "out_features":
                                                      layer.out_features, "bias": True,
                                                      "activation_function": activation}))
        save_file({"linear.weight": layer.weight.detach().contiguous(), "linear.bias": layer.bias.detach()},
                  str(path / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": path.name, "type": "sentence_transformers.models.Dense"})
    normalize = {"idx": 9, "name": "9", "path": "9_Normalize", "type": "sentence_transformers.models.Normalize"}
    modules += [*extra, normalize]
    (directory / "modules.json").write_text(json.dumps(modules))


def test_a_checkpoints_dense_layers_apply_after_pooling(tmp_path):
    """mean pooling -> Dense(64 -> 48, tanh) -> Dense(48 -> 32, identity) -> unit length, as sentence-transformers
    computes a checkpoint with those modules; the width the Matryoshka cut is checked against is 32."""
    hf = build("llama", tmp_path)
    torch.manual_seed(3)
    first, second = torch.nn.Linear(64, 48), torch.nn.Linear(48, 32)
    _sentence_transformers_layout(tmp_path, {"pooling_mode_mean_tokens": True},
                                  [("torch.nn.modules.activation.Tanh", first),
                                   ("torch.nn.modules.linear.Identity", second)])
    prompts = [[5, 9, 33, 7], [12, 4], [99, 100, 101, 102, 103, 104]]
    with torch.no_grad():
        pooled = torch.stack([hf.model(torch.tensor([p])).last_hidden_state[0].mean(0) for p in prompts])
        want = torch.nn.functional.normalize(second(torch.tanh(first(pooled))), dim=-1)
    engine = Engine.from_pretrained(tmp_path, max_batch_size=2, max_input_len=32, max_output_len=8)
    got = engine.embed(prompts)
    assert got.shape == (3, 32)
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ConfigError, match="dimensions=40: the model's vectors have 32 components"):
        engine.embed(prompts, dimensions=40)


@pytest.mark.parametrize("pooling, extra, message", [
    ({"pooling_mode_max_tokens": True}, [], r"pooling \['pooling_mode_max_tokens'\]"),
    ({"pooling_mode_mean_tokens": True, "include_prompt": False}, [], "include_prompt=false"),
    ({"pooling_mode_mean_tokens": True}, [{"idx": 5, "name": "5", "path": "5_LayerNorm",
                                           "type": "sentence_transformers.models.LayerNorm"}], "module 'LayerNorm'"),
])
def test_a_head_this_runtime_cannot_compute_is_refused_for_embedding_only(tmp_path, pooling, extra, message):
    build("llama", tmp_path)
    _sentence_transformers_layout(tmp_path, pooling, extra=extra)
    with pytest.raises(UnsupportedPooling, match=message):
        checkpoint_pooling(tmp_path)
    engine = Engine.from_pretrained(tmp_path, max_batch_size=2, max_input_len=32, max_output_len=8)
    with pytest.raises(ConfigError, match=message):
        engine.embed([[5, 6, 7]], pooling="mean")
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_bad_pooling_settings_are_refused():
    engine = Engine.from_pretrained(None, max_batch_size=2)
    with pytest.raises(ConfigError, match="pooling='max'"):
        engine.embed(["a"], pooling="max")
    with pytest.raises(ConfigError, match="dimensions=9999"):
        engine.embed(["a"], dimensions=9999)
    vectors = engine.embed(["The licensee shall not sublicense.", "Warranty disclaimed."])
    assert vectors.shape == (2, engine.config.hidden_size) and vectors.dtype == torch.float32
