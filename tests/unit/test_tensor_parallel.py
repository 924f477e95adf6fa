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


@pytest.mark.parametrize("arch", [*MOE_ARCHS, *MLA_ARCHS])
def test_experts_and_latent_attention_split_too(arch, tmp_path):
    """Experts split by intermediate columns (a shared expert and its gate too, a dense first layer);
    latent attention by heads, its latent projections and the DSA indexer replicated; DeepSeek-V3 with
    attention biases (o_proj's is added once, by rank 0)."""
    build(arch, tmp_path / arch, **({"attention_bias": True} if arch == "deepseek_v3" else {}))
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


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_each_rank_holds_its_share_of_the_weights(tmp_path, kv_heads):
    """Each rank's weights are within 10 % of 1/N of the whole (only norms are replicated, and KV heads
    where there are fewer than ranks), and the slices it loaded are the whole model's: rows of its
    heads / KV heads / vocabulary, of gate and up, columns of o_proj and down, its q / k / v biases."""
    d = tmp_path / "wide"
    build("qwen2", d, hidden_size=128, intermediate_size=512, num_attention_heads=8, num_key_value_heads=kv_heads,
          vocab_size=2048, num_hidden_layers=3, tie_word_embeddings=False)
    cfg = ModelConfig.from_dir(d)
    whole = load_model(d, torch.float32, torch.device("cpu"), 64, cfg)
    total = _weight_bytes(whole)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for n in (2, 4):
        ranks = [load_model(d, torch.float32, torch.device("cpu"), 64, cfg, TensorShard(r, n)) for r in range(n)]
        replicated_kv = kv_heads < n
        for rank in ranks:
            tolerance = 0.10 if not replicated_kv else 0.25  # each rank keeps a whole KV head: k and v rows repeat
            assert abs(_weight_bytes(rank) - total / n) <= tolerance * total / n
        assert torch.equal(torch.cat([r.embed for r in ranks])[: cfg.vocab_size], whole.embed)
        assert torch.equal(torch.cat([r.lm_head.weight for r in ranks]), whole.lm_head.weight)
        for layer in range(cfg.num_layers):
            mine = [r.layers[layer] for r in ranks]
            full = whole.layers[layer]
            assert torch.equal(torch.cat([m.mlp.down.weight for m in mine], dim=1), full.mlp.down.weight)
            assert torch.equal(torch.cat([m.attn.o_proj.weight for m in mine], dim=1), full.attn.o_proj.weight)
            gate_up = [m.mlp.gate_up.weight.view(2, inter // n, -1) for m in mine]
            assert torch.equal(torch.cat(gate_up, dim=1).view(2 * inter, -1), full.mlp.gate_up.weight)
            for param in ("weight", "bias"):
                local = [getattr(m.attn.qkv, param) for m in mine]
                whole_qkv = getattr(full.attn.qkv, param)
                assert torch.equal(torch.cat([t[: q // n] for t in local]), whole_qkv[:q])
                head = cfg.head_dim
                for part in (1, 2):  # k, v: rank r holds KV heads r*Hkv/N.., or the one its query heads read
                    got = [t[q // n + (part - 1) * len(t[q // n :]) // 2 :][: len(t[q // n :]) // 2] for t in local]
                    want = whole_qkv[q + (part - 1) * kv : q + part * kv]
                    first = [TensorShard(r, n).kv_heads(cfg)[0] for r in range(n)]
                    if replicated_kv:
                        for r, g in enumerate(got):
                            assert torch.equal(g, want[first[r] * head : (first[r] + 1) * head])
                    else:
                        assert torch.equal(torch.cat(got), want)


def test_sizes_that_do_not_split_the_model_are_refused(tiny_models):
    model_dir = tiny_models["llama"][0]
    with pytest.raises(ConfigError, match=r"4 attention heads \(sizes that divide them: \[2, 4\]\)"):
        cpu_engine(model_dir, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="torch backend"):
        cpu_engine(model_dir, backend="onnx", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        cpu_engine(model_dir, tensor_parallel_size=0)


def test_a_rank_that_dies_breaks_the_replica_at_once(tiny_models):
    """A killed rank: rank 0's next collective fails (ReplicaBroken, never a hang), the replica refuses
    further work, and closing it returns."""
    model_dir = tiny_models["llama"][0]
    engine = cpu_engine(model_dir, tensor_parallel_size=2, max_output_len=256)
    engine.generate(prompts(1, (5,)), PARAMS)  # a healthy replica first
    follower = engine.replica.local.processes[0]
    os.kill(follower.pid, signal.SIGKILL)  # the event: the rank is gone before the next call
    follower.wait(timeout=30)
    outcome: list[BaseException | None] = []

    def next_call() -> None:
        try:
            engine.generate(prompts(1, (5, 17, 9)), SamplingParams(max_new_tokens=200, ignore_eos=True))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    caller = threading.Thread(target=next_call, daemon=True)
    caller.start()
    caller.join(timeout=120)  # a watchdog against a hang, not a speed claim
    assert not caller.is_alive(), "rank 0 hung on a dead rank"
    assert isinstance(outcome[0], ReplicaBroken) and "rank 0 of 2" in str(outcome[0])
    with pytest.raises(ReplicaBroken, match="broke earlier"):
        engine.generate(prompts(1, (5,)), PARAMS)
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(timeout=120)
    assert not closer.is_alive(), "close() hung on a broken replica"


def test_an_error_inside_a_step_stops_the_replica_and_close_stops_healthy_ranks(tiny_models):
    """An error raised while the ranks run a call may leave them in different collectives: the replica is
    stopped (ReplicaBroken naming the error, the other ranks ended) rather than trusted; a healthy
    replica's close() lets its ranks leave on their own (exit 0). Direct runner helpers are refused."""
    model_dir = tiny_models["llama"][0]
    with cpu_engine(model_dir, tensor_parallel_size=2) as healthy:
        assert _tokens(healthy, prompts(2, (7, 12)))
        with pytest.raises(TypeError, match="not available on a tensor-parallel replica"):
            _ = healthy.runner.compress
        processes = list(healthy.replica.local.processes)
    assert [p.wait(10) for p in processes] == [0]
    engine = cpu_engine(model_dir, tensor_parallel_size=2)
    processes = list(engine.replica.local.processes)
    too_far = torch.tensor([[0, 10_000]])  # past the rotary table: the runner's own check raises on every rank
    with pytest.raises(ReplicaBroken, match="ValueError"):
        engine.runner.target_logprobs(torch.tensor([[5, 6]]), torch.tensor([0]), torch.tensor([7]), too_far)
    assert all(p.wait(10) != 0 for p in processes)  # ended by rank 0 (or by their own broken collective)
    with pytest.raises(ReplicaBroken):
        engine.generate(prompts(1, (5,)), PARAMS)
    engine.close()


def test_constrained_rows_on_a_replica():
    """Grammar masks stay on rank 0, which samples for every rank: the same constrained tokens as one rank."""
    from flashx_batch import Engine

    schema = {"type": "object", "properties": {"kind": {"enum": ["licence", "lease"]},
                                               "who": {"type": "string", "maxLength": 10}},
              "required": ["kind", "who"], "additionalProperties": False}
    texts = [f"Clause {i}: the licensee shall not sublicense." for i in range(5)]
    params = [SamplingParams(max_new_tokens=32, json_schema=schema), SamplingParams(max_new_tokens=8),
              SamplingParams(max_new_tokens=8, choice=["yes", "no"]),
              SamplingParams(max_new_tokens=32, regex="[0-9]{4}"),
              SamplingParams(max_new_tokens=32, json_schema=schema, temperature=1.0, seed=3)]
    want = Engine.from_pretrained(None, max_batch_size=2).generate(texts, params)
    with Engine.from_pretrained(None, max_batch_size=2, tensor_parallel_size=2) as tp:
        got = tp.generate(texts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.constraint_met for o in got] == [True, None, True, True, True]
