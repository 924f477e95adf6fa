"""Sampling on the device: seeded, batch-independent, and faithful to the softmax it samples."""

import math

import pytest
import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.sampling import SamplingBatch, sample, uniform_noise


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine.from_pretrained(tiny_models["qwen2"][0], backend="cpu", dtype="float32", max_batch_size=4,
                                  max_input_len=64, max_output_len=32, segment_size=16, sort_by_length=False)


PROMPTS = [[5, 9, 33, 71], [100, 4, 4, 8, 12, 90, 61], [17] * 12, [200, 201]]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True)
              for s in (11, 12, 13, 14)]
    first = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    alone = engine.generate([PROMPTS[2]], [params[2]])[0]
    shuffled = engine.generate([PROMPTS[3], PROMPTS[2], PROMPTS[0]], [params[3], params[2], params[0]])
    assert alone.token_ids == first[2].token_ids == shuffled[1].token_ids
    other_seed = engine.generate([PROMPTS[2]], [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9,
                                                               seed=99, ignore_eos=True)])[0]
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))
    topk1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1, seed=5,
                                                    ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def _frequencies(logits, params, draws=20000):
    batch = SamplingBatch.build([params] * draws, logits.numel(), torch.device("cpu"))
    tokens = sample(logits.expand(draws, -1).contiguous(), batch, torch.arange(draws))
    return torch.bincount(tokens, minlength=logits.numel()).float() / draws


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=1.0), None),
    (SamplingParams(temperature=0.5), None),
    (SamplingParams(temperature=1.0, top_k=2), [0.0, 0.0, 0.0, 1.0, 2.0]),
    (SamplingParams(temperature=1.0, top_p=0.6), [0.0, 0.0, 0.0, 1.0, 2.0]),
    (SamplingParams(temperature=1.0, top_p=0.69), [0.0, 0.0, 1.0, 1.0, 2.0]),
])
def test_sampled_frequencies_follow_the_softmax(params, expected):
    logits = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0]])
    probs = (logits[0] / params.temperature).softmax(-1)
    # softmax = .058 .096 .158 .260 .429: top-p keeps tokens until the mass before them reaches p
    if expected is not None:
        keep = torch.tensor(expected) > 0
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    freq = _frequencies(logits, params)
    # chi-square with 4 degrees of freedom: 99.9th percentile is 18.47
    mask = probs > 0
    chi2 = (((freq - probs) ** 2 / probs.clamp_min(1e-12))[mask]).sum().item() * 20000
    assert chi2 < 18.47, (freq, probs)
    assert (freq[~mask] == 0).all()


def test_noise_is_uniform_and_deterministic():
    seeds = torch.tensor([1, 2, 3], dtype=torch.long)
    u = uniform_noise(seeds, torch.zeros(3, dtype=torch.long), 50000)
    assert torch.equal(u, uniform_noise(seeds, torch.zeros(3, dtype=torch.long), 50000))
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u[0], u[1])
    assert math.isfinite(-math.log(-math.log(u.min().item())))


def test_invalid_sampling_values_are_clear_errors():
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))):
        with pytest.raises(ConfigError, match="sampling"):
            SamplingParams(**bad)


def test_max_new_tokens_beyond_the_arena_is_refused(engine):
    with pytest.raises(ConfigError, match="max_output_len"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=33))


def test_token_ids_outside_the_vocabulary_are_a_clear_error(engine):
    vocab = engine.config.vocab_size
    with pytest.raises(ConfigError, match=f"prompt 1 holds token id {vocab}, outside the model's vocabulary"):
        engine.generate([[5, 6], [7, vocab, 8]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ConfigError, match="token id -3"):
        engine.generate([[-3, 4]], SamplingParams(max_new_tokens=2))
    assert engine.scheduler.allocator.is_whole()  # refused before anything was allocated
