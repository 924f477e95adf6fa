"""Latent attention (DeepSeek-V3, GLM-5) and GLM-5's sparse-attention indexer: greedy tokens and prefill
logits equal `transformers`' (GLM-5 with its index_topk below and above the rows' lengths, and with
shared indexer layers), rows independent of their batch, every lossless layout and prefix reuse keep the
tokens, the cache holds the latent entry per token (bytes from the arena), the absorbed decode form
equals the expanded one, and what cannot apply is refused."""

import json
import shutil

import pytest
import torch
from model_factory import MLA_ARCHS, build
from parity_support import assert_batch_and_position_independent, cpu_engine, hf_greedy, prompts, stable_topk

from flashx_batch import SamplingParams
from flashx_batch.errors import ConfigError
from flashx_batch.models.mla import MLAttention, top_keys

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 17, 9, 30, 12)  # GLM-5's index_topk (8) is below most of them


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    models = {arch: (root / arch, build(arch, root / arch)) for arch in MLA_ARCHS}
    # the same GLM-5 with index_topk above every row's length (dense attention), and with shared indexer layers
    models["glm_moe_dsa_dense"] = (root / "dense", build("glm_moe_dsa", root / "dense", index_topk=256))
    models["glm_moe_dsa_shared"] = (root / "shared", build("glm_moe_dsa", root / "shared", seed=3,
                                                           indexer_types=["full", "shared", "shared"]))
    return models


def _assert_matches_transformers(model_dir, hf, lengths=PROMPT_LENGTHS, seed=1):
    engine = cpu_engine(model_dir)
    rows = prompts(seed, lengths)
    outs = engine.generate(rows, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    # `transformers` with the indexer's tie rule ours follows (its own topk breaks ties by row width)
    with stable_topk():
        for prompt, out in zip(rows, outs):
            assert len(set(out.token_ids)) >= 8
            assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
        for prompt, logits in zip(rows, engine.score(rows)):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float()
            assert (logits - ref).abs().max().item() <= 1e-4
    return engine


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa", "glm_moe_dsa_dense", "glm_moe_dsa_shared"])
def test_greedy_tokens_and_prefill_logits_match_transformers(name, mla_models):
    model_dir, hf = mla_models[name]
    engine = _assert_matches_transformers(model_dir, hf)
    attn = [layer.attn for layer in engine.runner.model.layers]
    assert all(isinstance(a, MLAttention) for a in attn)
    indexers = [a.indexer is not None for a in attn]
    expected = {"deepseek_v3": [False] * 3, "glm_moe_dsa_shared": [True, False, False]}.get(name, [True] * 3)
    assert indexers == expected


def test_top_keys_takes_ties_in_key_order_whatever_the_row_width():
    row = torch.tensor([1.0, 0, 0, 3, 0, 0, 2, 0])
    kept = top_keys(row[None], 4)[0]
    assert kept.nonzero().flatten().tolist() == [0, 1, 3, 6]  # 3, 2, 1, then the earliest of the zeros
    padded = top_keys(torch.cat((row, torch.full((40,), float("-inf"))))[None], 4)[0]
    assert torch.equal(padded[:8], kept) and not padded[8:].any()
    assert top_keys(torch.tensor([[0.5, float("-inf"), float("-inf")]]), 2)[0].sum() == 2  # k kept, always


def test_indexer_ties_keep_the_same_keys_in_prefill_and_decode(tmp_path):
    """Every indexer score tied (index queries zeroed, two index heads: each key scores exactly 0):
    decode steps keep the keys the prefill keeps, so greedy tokens are the argmax of the teacher-forced
    logits of the same text, and `transformers` with the same tie rule gives the same tokens."""
    from model_factory import build

    hf = build("glm_moe_dsa", tmp_path / "ties", seed=5, index_n_heads=2)
    with torch.no_grad():
        for layer in hf.model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                layer.self_attn.indexer.wq_b.weight.zero_()
    hf.save_pretrained(tmp_path / "ties")
    engine = cpu_engine(tmp_path / "ties")
    rows = prompts(2, (17, 30, 12))
    outs = engine.generate(rows, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, out, logits in zip(rows, outs, engine.score([p + o.token_ids for p, o in zip(rows, outs)])):
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out.token_ids
        with stable_topk():
            assert hf_greedy(hf, prompt, 12) == out.token_ids


def test_the_indexer_changes_attention_only_past_index_topk(mla_models):
    """Same weights, index_topk 8 vs 256: equal logits (to float rounding: the masks reach the kernel in
    different forms) while a row is at most 8 tokens long, different after (so the selection is applied,
    not just computed)."""
    sparse_dir, _ = mla_models["glm_moe_dsa"]
    dense_dir = sparse_dir.parent / "glm5_wide"
    shutil.copytree(sparse_dir, dense_dir)
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["index_topk"] = 256
    (dense_dir / "config.json").write_text(json.dumps(cfg))
    row = prompts(4, (24,))
    sparse, dense = cpu_engine(sparse_dir).score(row)[0], cpu_engine(dense_dir).score(row)[0]
    assert (sparse[:8] - dense[:8]).abs().max().item() <= 1e-5
    assert (sparse[8:] - dense[8:]).abs().amax(dim=-1).min().item() > 1e-3


@pytest.mark.parametrize("layout", [{"kv_layout": "stripes"}, {"refill": False}, {"sort_by_length": False},
                                    {"prefix_cache_tokens": 256}, {"dtype": "bfloat16"}])
def test_layouts_and_prefix_reuse_keep_the_tokens(layout, mla_models):
    """Every lossless layout gives the default layout's tokens. bfloat16's tokens are its own: teacher-forced on
    the float32 engine's sequences, its top-1 agreement with float32 is held to what `transformers` keeps in
    bfloat16 on the same weights (the DSA indexer's top-k makes this tiny model sensitive to rounding: ~0.7 for
    both)."""
    model_dir, hf = mla_models["glm_moe_dsa"]
    rows = prompts(2, (40, 7, 22, 61, 15, 33))
    if "prefix_cache_tokens" in layout:  # a shared 20-token head, as a few-shot prompt gives
        rows = [rows[0][:20] + r for r in rows]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 3, 12, 30, 1, 9)]
    reference = [o.token_ids for o in cpu_engine(model_dir, max_input_len=96).generate(rows, params)]
    engine = cpu_engine(model_dir, max_input_len=96, **layout)
    got = [o.token_ids for o in engine.generate(rows, params)]
    if layout.get("dtype") == "bfloat16":
        assert [len(t) for t in got] == [len(t) for t in reference]
        import copy

        sequences = [r + t for r, t in zip(rows, reference, strict=True)]
        with torch.no_grad(), stable_topk():
            theirs32 = [hf(torch.tensor([s])).logits[0] for s in sequences]
            half = copy.deepcopy(hf).to(torch.bfloat16)
            theirs16 = [half(torch.tensor([s])).logits[0].float() for s in sequences]
        ours32 = cpu_engine(model_dir, max_input_len=96).score(sequences)

        def agreement(a, b):
            return sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b, strict=True)) / sum(
                len(x) for x in a)

        ours, theirs = agreement(engine.score(sequences), ours32), agreement(theirs16, theirs32)
        assert ours >= theirs - 0.03 and theirs > 0.5, (ours, theirs)
    else:
        assert got == reference
    if "prefix_cache_tokens" in layout:
        assert engine.last_stats.cached_prompt_tokens > 0


def test_a_row_is_independent_of_its_batch_and_position(mla_models):
    model_dir, _ = mla_models["glm_moe_dsa"]
    engine = cpu_engine(model_dir, sort_by_length=False)
    assert_batch_and_position_independent(engine, prompts(7, (11,))[0], prompts(8, (3, 25, 40, 8, 19)))


@pytest.mark.parametrize("dtype, size", [("float32", 4), ("bfloat16", 2)])
def test_the_cache_holds_the_latent_per_token(dtype, size, mla_models):
    """Bytes per token per layer, measured from the arena: (kv_lora_rank + qk_rope_head_dim) values for
    DeepSeek-V3, plus the indexer's key (index_head_dim) for GLM-5; a dense model keeps 2 x heads x head_dim."""
    for name, values in (("deepseek_v3", 32 + 16), ("glm_moe_dsa", 32 + 16 + 32)):
        engine = cpu_engine(mla_models[name][0], dtype=dtype)
        arena = engine.runner.arena
        assert arena.layer_slot_bytes() == values * size
        assert arena.bytes_per_token() == 3 * values * size
        assert arena.nbytes == arena.num_slots * 3 * values * size
        # full keys and values for the model's own heads would take heads x (key + value) values per token
        attn = engine.runner.model.layers[0].attn
        assert arena.layer_slot_bytes() < attn.num_heads * (attn.nope + attn.rope + attn.v_dim) * size


def test_absorbed_decode_equals_expanded_attention(mla_models):
    """The decode form (kv_b folded into the query and the output) computes the prefill form's attention."""
    engine = cpu_engine(mla_models["deepseek_v3"][0])
    attn = engine.runner.model.layers[1].attn
    g = torch.Generator().manual_seed(0)
    q_nope, q_rot = torch.randn(3, 1, 4, 16, generator=g), torch.randn(3, 1, 4, 16, generator=g)
    keys = torch.randn(3, 20, 48, generator=g)
    mask = torch.zeros(3, 1, 1, 20).masked_fill(torch.arange(20) > torch.tensor([[[[5]]], [[[19]]], [[[11]]]]),
                                                float("-inf"))
    with torch.no_grad():
        absorbed = attn._absorbed(q_nope, q_rot, keys, mask)
        expanded = attn._expanded(q_nope, q_rot, keys, mask)
    assert absorbed.shape == expanded.shape == (3, 1, 4, 24)
    assert torch.allclose(absorbed, expanded, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options, says", [
    ({"cache_policy": "segment_sparse"}, "caches GLM-5 sparse (DSA) latent attention entries"),
    ({"long_input": "rolling_merge"}, "merge full keys and values"),
    ({"backend": "onnx", "dtype": "float32"}, "runs on a torch backend"),
])
def test_what_latent_attention_cannot_run_is_refused(options, says, mla_models):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        cpu_engine(mla_models["glm_moe_dsa"][0], **options)
