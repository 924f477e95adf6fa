"""Tensor-parallel replicas on CPU (gloo, local rank processes): the same greedy tokens as one rank and
logits within 1e-5 of the logits' scale (float32), with mixed prompt lengths, refill and segment-sparse
KV; each rank holding 1/N of the weights; a dead rank an error, never a hang.

Why relative to the scale: a rank sums its share of each projection's inputs and the all-reduce adds
the shares, a different float32 summation order from one rank's single GEMM, so every logit moves by a
few units in the last place of the largest values in its computation. One rank alone moves as much
between batch sizes (measured: 0.5-1.2e-5 on these models, whose logits reach ~10)."""

import os
import signal
import threading
import time

import pytest
import torch
from model_factory import ARCHS, MLA_ARCHS, MOE_ARCHS, build
from parity_support import cpu_engine, prompts

from flashx_batch import SamplingParams
from flashx_batch.backends.distributed import ReplicaBroken
from flashx_batch.errors import ConfigError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.loader import load_model
from flashx_batch.models.parallel import TensorShard

# more rows than a batch holds (refill), lengths from 5 to the 64-token limit (segment-sparse merges the long ones)
LENGTHS = (5, 64, 17, 41, 9, 58, 30, 12)
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


def _tokens(engine, rows):
    return [o.token_ids for o in engine.generate(rows, PARAMS)]


def _assert_logits_close(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def _check_against_one_rank(model_dir, sizes, policies=("static", "segment_sparse"), seed=3):
    rows = prompts(seed, LENGTHS)
    for policy in policies:
        one = cpu_engine(model_dir, cache_policy=policy)
        want = _tokens(one, rows)
        stats = one.last_stats
        if policy == "segment_sparse":  # the merges ran: fewer KV bytes than a static cache held
            assert stats.kv_bytes_peak < stats.kv_bytes_static_peak
        assert stats.peak_rows <= one.admitted_batch_size * 4 and stats.rows == len(rows)
        want_logits = one.score(rows) if policy == "static" else None
        for n in sizes:
            with cpu_engine(model_dir, cache_policy=policy, tensor_parallel_size=n) as tp:
                assert _tokens(tp, rows) == want, (policy, n)
                if want_logits is not None:
                    _assert_logits_close(tp.score(rows), want_logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp_2_and_4_match_one_rank(arch, tiny_models):
    _check_against_one_rank(tiny_models[arch][0], (2, 4))


@pytest.mark.parametrize("arch", [MOE_ARCHS[0], MOE_ARCHS[1], MLA_ARCHS[1]])
def test_experts_and_latent_attention_split_too(arch, tmp_path):
    """Experts split by intermediate columns (a shared expert and its gate too); latent attention by heads,
    its latent projections and the DSA indexer replicated."""
    build(arch, tmp_path / arch)
    _check_against_one_rank(tmp_path / arch, (2,), policies=("static",))


def test_prefix_reuse_on_a_replica(tiny_models):
    """Shared prefixes computed once and read by later rows: the cache's slot plans reach every rank."""
    model_dir = tiny_models["glm4"][0]
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 256, (40,), generator=g).tolist()
    rows = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 14, 6, 11)]
    opts = dict(max_input_len=64, prefix_cache_tokens=128, segment_size=8)
    one = cpu_engine(model_dir, **opts)
    want = _tokens(one, rows)
    assert one.last_stats.cached_prompt_tokens > 0
    with cpu_engine(model_dir, tensor_parallel_size=2, **opts) as tp:
        assert _tokens(tp, rows) == want
        assert tp.last_stats.cached_prompt_tokens == one.last_stats.cached_prompt_tokens


def test_loglikelihood_is_the_same_on_a_replica(tiny_models):
    model_dir = tiny_models["qwen2"][0]
    pairs = [(p[:-4], p[-4:]) for p in prompts(5, (12, 30, 21))]
    want = cpu_engine(model_dir).loglikelihood(pairs)
    with cpu_engine(model_dir, tensor_parallel_size=2) as tp:
        got = tp.loglikelihood(pairs)
    assert [g for _, g in got] == [g for _, g in want]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_each_rank_holds_its_share_of_the_weights(tmp_path):
    """Each rank's weights are within 10 % of 1/N of the whole (only norms are replicated), and the
    slices it loaded are the whole model's: rows of its heads / vocabulary, columns of its MLP."""
    d = tmp_path / "wide"
    build("qwen2", d, hidden_size=128, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
          vocab_size=2048, num_hidden_layers=3, tie_word_embeddings=False)
    cfg = ModelConfig.from_dir(d)
    whole = load_model(d, torch.float32, torch.device("cpu"), 64, cfg)
    total = _weight_bytes(whole)
    for n in (2, 4):
        ranks = [load_model(d, torch.float32, torch.device("cpu"), 64, cfg, TensorShard(r, n)) for r in range(n)]
        for rank in ranks:
            assert abs(_weight_bytes(rank) - total / n) <= 0.10 * total / n
        assert torch.equal(torch.cat([r.embed for r in ranks])[: cfg.vocab_size], whole.embed)
        assert torch.equal(torch.cat([r.lm_head.weight for r in ranks]), whole.lm_head.weight)
        down = torch.cat([r.layers[1].mlp.down.weight for r in ranks], dim=1)
        assert torch.equal(down, whole.layers[1].mlp.down.weight)
        o_proj = torch.cat([r.layers[0].attn.o_proj.weight for r in ranks], dim=1)
        assert torch.equal(o_proj, whole.layers[0].attn.o_proj.weight)
        q_rows, kv_rows = cfg.q_size // n, cfg.kv_size // n
        q = torch.cat([r.layers[2].attn.qkv.weight[:q_rows] for r in ranks])
        k = torch.cat([r.layers[2].attn.qkv.weight[q_rows : q_rows + kv_rows] for r in ranks])
        assert torch.equal(q, whole.layers[2].attn.qkv.weight[: cfg.q_size])
        assert torch.equal(k, whole.layers[2].attn.qkv.weight[cfg.q_size : cfg.q_size + cfg.kv_size])


def test_sizes_that_do_not_split_the_model_are_refused(tiny_models):
    model_dir = tiny_models["llama"][0]
    with pytest.raises(ConfigError, match=r"4 attention heads \(sizes that divide them: \[2, 4\]\)"):
        cpu_engine(model_dir, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="torch backend"):
        cpu_engine(model_dir, backend="onnx", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        cpu_engine(model_dir, tensor_parallel_size=0)


def test_a_rank_that_dies_breaks_the_replica_at_once(tiny_models):
    """A killed rank: rank 0's next collective fails (ReplicaBroken, within seconds, never a hang) and
    the replica refuses further work; closing it returns."""
    model_dir = tiny_models["llama"][0]
    engine = cpu_engine(model_dir, tensor_parallel_size=2, max_output_len=256)
    follower = engine.replica.local.processes[0]
    killer = threading.Timer(0.5, os.kill, (follower.pid, signal.SIGKILL))
    started = time.monotonic()
    killer.start()
    with pytest.raises(ReplicaBroken, match="rank 0 of 2"):
        for _ in range(200):
            engine.generate(prompts(1, (5, 17, 9)), SamplingParams(max_new_tokens=200, ignore_eos=True))
    assert time.monotonic() - started < 60
    with pytest.raises(ReplicaBroken, match="broke earlier"):
        engine.generate(prompts(1, (5,)), PARAMS)
    engine.close()
    assert follower.poll() is not None
