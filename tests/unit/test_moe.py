"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral, GLM-4.5 with
sigmoid routing in expert groups, a correction bias, a shared expert and a first dense layer; 8 experts,
top-2): greedy tokens and prefill logits equal `transformers`', rows independent of their batch, in
every batch layout; tokens grouped by expert, expert weights loaded stacked."""

import pytest
import torch
from model_factory import MOE_ARCHS, build
from parity_support import assert_batch_and_position_independent, cpu_engine, hf_greedy, prompts

from flashx_batch import SamplingParams
from flashx_batch.models.moe import SparseMoE

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: (root / arch, build(arch, root / arch)) for arch in MOE_ARCHS}


_prompts, _engine, _hf_greedy = prompts, cpu_engine, hf_greedy


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_and_prefill_logits_match_transformers(arch, moe_models):
    model_dir, hf = moe_models[arch]
    engine = _engine(model_dir)
    moe = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(moe) == 2 and moe[0].experts_gate_up.shape[0] == 8  # sparse layers, experts stacked
    assert (moe[0].shared is not None) == (arch in ("qwen2_moe", "glm4_moe"))
    assert (moe[0].shared_gate is not None) == (arch == "qwen2_moe")
    prompts = _prompts(1, (5, 17, 9, 30, 12))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert len(set(out.token_ids)) >= 8
        assert out.token_ids == _hf_greedy(hf, prompt, NEW_TOKENS)
    for prompt, logits in zip(prompts, engine.score(prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("layout", [{"kv_layout": "stripes"}, {"refill": False}, {"sort_by_length": False},
                                    {"prefix_cache_tokens": 256},
                                    {"cache_policy": "segment_sparse", "kv_observe_window": 8}])
def test_layouts_keep_the_tokens(layout, moe_models):
    """The experts are the MLP only: every batch layout gives the default layout's tokens. Segment-sparse is
    lossy: its rows' first tokens (from the uncompressed prefill) are the default's, a compressed row's tokens
    are its own whatever its batch (the same alone), and its KV peak is lower."""
    model_dir, _ = moe_models["qwen3_moe"]
    prompts = _prompts(2, (40, 7, 22, 61, 15, 33))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 3, 12, 30, 1, 9)]
    reference = [o.token_ids for o in _engine(model_dir).generate(prompts, params)]
    engine = _engine(model_dir, **layout)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    if layout.get("cache_policy") == "segment_sparse":
        assert [t[:1] for t in got] == [t[:1] for t in reference]
        assert [len(t) for t in got] == [len(t) for t in reference]
        assert engine.last_stats.kv_bytes_peak < engine.last_stats.kv_bytes_static_peak
        assert got != reference  # the 61-token row was compressed: lossy, not silently the full cache
        assert engine.generate([prompts[3]], params[3])[0].token_ids == got[3]
    else:
        assert got == reference


def test_a_row_is_independent_of_its_batch_and_position(moe_models):
    model_dir, _ = moe_models["mixtral"]
    engine = _engine(model_dir, sort_by_length=False)
    assert_batch_and_position_independent(engine, _prompts(7, (11,))[0], _prompts(8, (3, 25, 40, 8, 19)))


def test_routing_groups_tokens_by_expert_and_weights_them():
    """Against a per-token loop: each token's output is the weighted sum of its chosen experts."""
    from flashx_batch.models.config import MoESpec

    torch.manual_seed(0)
    spec = MoESpec(num_experts=4, top_k=2, intermediate=8, norm_topk_prob=True, sparse_layers=(True,))
    moe = SparseMoE(spec, 16, torch.float32, torch.device("cpu"))
    for p in moe.parameters():
        p.data.normal_()
    x = torch.randn(2, 5, 16)
    out = moe.forward(x)
    chosen, weights = moe.route(x.reshape(-1, 16))
    for t, token in enumerate(x.reshape(-1, 16)):
        expected = torch.zeros(16)
        for e, w in zip(chosen[t].tolist(), weights[t]):
            gate, up = (moe.experts_gate_up[e] @ token).split(8)
            expected += w * (moe.experts_down[e] @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(out.reshape(-1, 16)[t], expected, atol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(10))  # norm_topk_prob


def _random_moe(experts: int, top_k: int, intermediate: int, hidden: int, seed: int) -> SparseMoE:
    """A float32 CPU `SparseMoE` with normal random weights (router included)."""
    from flashx_batch.models.config import MoESpec

    torch.manual_seed(seed)
    spec = MoESpec(num_experts=experts, top_k=top_k, intermediate=intermediate, norm_topk_prob=True,
                   sparse_layers=(True,))
    moe = SparseMoE(spec, hidden, torch.float32, torch.device("cpu"))
    for p in moe.parameters():
        p.data.normal_()
    return moe


@pytest.mark.parametrize("tokens, form", [(3, "grouped"), (40, "grouped"), (12000, "loop")])
def test_grouped_experts_equal_the_loop_and_serve_few_rows_an_expert(tokens, form, monkeypatch):
    """The grouped GEMM form (few rows an expert, empty experts included) gives the loop's output bit for bit
    on the CPU and is the form a decode-sized call takes; many rows an expert (a prefill) take the loop."""
    from flashx_batch.models import moe as moe_module

    if not moe_module.grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no grouped GEMM on the CPU")
    moe = _random_moe(experts=32, top_k=4, intermediate=24, hidden=48, seed=1)
    x = torch.randn(tokens, 48)
    original, calls = SparseMoE._grouped, []

    def spy(self, rows, ends):
        calls.append(len(rows))
        return original(self, rows, ends)

    monkeypatch.setattr(SparseMoE, "_grouped", spy)
    monkeypatch.setattr(moe_module, "DECODE_MAX_PAIRS", 0)  # the grouped GEMM, not the host decode kernel
    first = moe.forward(x)
    assert calls == ([tokens * 4] if form == "grouped" else [])
    monkeypatch.setattr(moe_module, "GROUPED_MAX_MACS", 0 if form == "grouped" else 10**12)  # the other form
    assert torch.equal(first, moe.forward(x))
    if tokens == 3:  # 12 rows over 32 experts: empty experts in the grouped GEMM
        assert int(torch.bincount(moe.route(x)[0].reshape(-1), minlength=32).eq(0).sum()) > 0


def _decode_step(monkeypatch):
    """A 64-expert top-8 layer, a decode step's 8 tokens (64 pairs), and the list of its calls into the host
    decode kernel; skips where numba is unavailable."""
    from flashx_batch.backends import cpu_moe

    if cpu_moe.kernel() is None:
        pytest.skip("numba unavailable")
    moe = _random_moe(experts=64, top_k=8, intermediate=40, hidden=56, seed=2)
    original, calls = SparseMoE._decode_rows, []
    monkeypatch.setattr(SparseMoE, "_decode_rows", lambda self, *a: calls.append(1) or original(self, *a))
    return moe, torch.randn(8, 56), calls


def _forward_on(threads: int, moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return moe.forward(x)
    finally:
        torch.set_num_threads(before)


def test_the_host_decode_kernel_takes_decode_sized_calls_and_agrees_with_the_loop(monkeypatch):
    from flashx_batch.models import moe as moe_module

    moe, x, calls = _decode_step(monkeypatch)
    monkeypatch.setattr(moe_module, "DECODE_MIN_THREADS", 1)
    monkeypatch.setattr(moe_module, "DECODE_PAIRS_PER_EXPERT", 2)
    fast = moe.forward(x)
    monkeypatch.setattr(moe_module, "DECODE_MAX_PAIRS", 0)
    monkeypatch.setattr(moe_module, "GROUPED_MAX_MACS", 0)
    looped = moe.forward(x)
    assert calls == [1] and torch.allclose(fast, looped, rtol=1e-5, atol=1e-4)  # sums reassociated: last bits


def test_on_one_thread_or_dense_a_decode_step_takes_the_grouped_gemm(monkeypatch):
    """The decode kernel pays on two threads or more and where pairs are spread thin over the experts; else
    MKL's grouped GEMM serves. The thread count is read per call, so a job's own setting decides."""
    from flashx_batch.models import moe as moe_module

    moe, x, calls = _decode_step(monkeypatch)
    monkeypatch.setattr(moe_module, "DECODE_MIN_THREADS", 2)
    monkeypatch.setattr(moe_module, "DECODE_PAIRS_PER_EXPERT", 2)  # 64 pairs over 64 experts: thin enough
    one = _forward_on(1, moe, x)
    assert calls == []
    two = _forward_on(2, moe, x)
    assert calls == [1] and torch.allclose(one, two, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(moe_module, "DECODE_PAIRS_PER_EXPERT", 0.5)  # 64 pairs over 64 experts: too many
    _forward_on(2, moe, x)
    assert calls == [1]


def test_without_a_grouped_gemm_a_decode_step_takes_the_kernel_on_one_thread(monkeypatch):
    """Where this torch has no grouped GEMM, the kernel serves decode steps whatever the thread count: the
    other form is the loop over experts, with its read-back of the counts."""
    from flashx_batch.models import moe as moe_module

    moe, x, calls = _decode_step(monkeypatch)
    monkeypatch.setattr(moe_module, "grouped_mm_available", lambda device, dtype: False)
    _forward_on(1, moe, x)
    assert calls == [1]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bfloat16_experts_sum_as_the_reference_block_does(arch, moe_models):
    """In bfloat16 the routing weights' dtype and where the expert outputs are summed and rounded decide
    the last bit: our block must give the reference block's outputs exactly."""
    import transformers as tf

    _, hf = moe_models[arch]
    reference = hf.model.layers[1].mlp.to(torch.bfloat16)
    spec = _engine(moe_models[arch][0]).config.moe
    ours = SparseMoE(spec, hf.config.hidden_size, torch.bfloat16, torch.device("cpu"))
    ours.router.copy_(reference.gate.weight)
    ours.experts_gate_up.copy_(reference.experts.gate_up_proj)
    ours.experts_down.copy_(reference.experts.down_proj)
    x = torch.randn(3, 7, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(x)
    assert isinstance(reference, (tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
                                  tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock))
    assert torch.equal(ours.forward(x), expected[0] if isinstance(expected, tuple) else expected)


def test_what_the_expert_loop_cannot_run_is_refused(moe_models):
    from flashx_batch.backends import get_backend
    from flashx_batch.errors import ConfigError
    from flashx_batch.models.config import ModelConfig
    from flashx_batch.runtime.inputs import check_options
    from flashx_batch.runtime.options import EngineOptions

    cfg = ModelConfig.from_dir(moe_models["qwen3_moe"][0])
    for knobs in ({"backend": "onnx"}, {"cuda_graphs": "on"}):
        options = EngineOptions(**{"backend": "cpu", **knobs})
        with pytest.raises(ConfigError, match="mixture-of-experts"):
            check_options(options, cfg, None if knobs.get("backend") == "onnx" else get_backend("cpu"))


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(moe_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from flashx_batch.errors import ModelLoadError
    from flashx_batch.models.loader import check_checkpoint

    model_dir = tmp_path / "gap"
    shutil.copytree(moe_models["qwen3_moe"][0], model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    prefix = "model.layers.1.mlp.experts"
    tensors[f"{prefix}.9.gate_proj.weight"] = tensors.pop(f"{prefix}.3.gate_proj.weight")  # expert 3's gate gone
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts_gate_up .* missing part\(s\) \[6, "):
        check_checkpoint(model_dir)


def test_qwen_moe_configs_slide_only_when_asked(tmp_path):
    import json

    from flashx_batch.models.config import ModelConfig

    base = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32}
    for extra, window in (({"sliding_window": 32768, "use_sliding_window": False}, None),
                          ({"sliding_window": 0}, None),
                          ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, 8)):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        cfg = ModelConfig.from_dir(tmp_path)
        assert cfg.sliding_window == window and cfg.moe.shared_gate
