"""The fused int8 decode step (`models.int8_decode`) against the layer-by-layer modules it replaces."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.quant import int8_decode
from flashx_batch.quant.int8_decode import Int8Decode, Reads
from flashx_batch.runtime.torch_runner import TorchRunner

pytestmark = pytest.mark.skipif(int8_decode._kernels() is None, reason="numba cannot compile the fused kernels here")


def _prompts(rows: int) -> list[list[int]]:
    return [[5 + (i * 7 + j * 3) % 200 for j in range(9 + 11 * i)] for i in range(rows)]


def _engine(path, **options) -> Engine:
    return Engine.from_pretrained(path, backend="cpu", dtype="float32", max_batch_size=4, max_input_len=96,
                                  max_output_len=16, **options)


def test_each_fused_step_gives_the_layer_by_layer_hidden_states_and_cache(tiny_models, monkeypatch):
    """Every decode step runs both ways on the same cache: the fused step's hidden states and the keys and
    values it wrote match the modules' (the norm sums in another order, so a rare int8 code may differ by
    a step: a tolerance, not bit equality); the modules' values are kept, so both see the same history."""
    engine = _engine(tiny_models["llama"][0])
    quantize_all(engine)
    runner = engine.runner
    compared = []
    step_hidden = TorchRunner.step_hidden

    def both(self, tokens, positions, write_flat, mask, runs, extents=None):
        assert extents is not None, "the engine's CPU decode steps read rows in extents"
        self.fuse_int8_decode = True
        fused = step_hidden(self, tokens, positions, write_flat, mask, runs, extents)
        written = [(k[write_flat].clone(), v[write_flat].clone()) for k, v in self.caches]
        self.fuse_int8_decode = False
        plain = step_hidden(self, tokens, positions, write_flat, mask, runs, extents)
        scale = plain.abs().max()
        # a wrong scale, RoPE or cache slot is off everywhere, every step; a code one step off (the norm's
        # last bit) moves a few values by ~1 % of the largest
        compared.append(max([((fused - plain).abs().max() / scale).item()] +
                            [((a - b[write_flat]).abs().max() / b[write_flat].abs().max()).item()
                             for pair, cache in zip(written, self.caches, strict=True)
                             for a, b in zip(pair, cache, strict=True)]))
        return plain

    monkeypatch.setattr(TorchRunner, "step_hidden", both)
    out = engine.generate(_prompts(4), SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in out)
    assert runner._fused is not None and runner._fused[1] is not None, "the fused step did not serve this model"
    assert len(compared) >= 11
    assert statistics.median(compared) < 1e-5 and max(compared) < 0.1, compared


@pytest.mark.parametrize("options", [{}, dict(prefix_cache_tokens=32)])
def test_fused_and_layer_by_layer_decoding_give_the_same_tokens(tiny_models, monkeypatch, options):
    """Greedy tokens with the step fused and without, rows of different lengths: in extents of their own,
    and (with a prefix cache) a paged batch whose rows read shared prefix segments through slot tables."""
    engine = _engine(tiny_models["llama"][0], segment_size=8, **options)
    quantize_all(engine)
    prompts = _prompts(5)
    prompts += [prompts[2][:18] + [7, 9, 11], prompts[2][:18] + [13]]  # share whole segments with a batch-mate
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    reads, hidden = [], Int8Decode.hidden

    def spy(self, tokens, positions, write_flat, r):
        reads.append("paged" if r.bias.size else "extents")
        return hidden(self, tokens, positions, write_flat, r)

    monkeypatch.setattr(Int8Decode, "hidden", spy)
    tokens = {}
    for fused in (True, False):
        engine.runner.fuse_int8_decode = fused
        tokens[fused] = [o.token_ids for o in engine.generate(prompts, params)]
    assert ("paged" if options else "extents") in reads
    # the same tokens but where a code one step off (the norm's last bit) tips a near tie: one row at most
    assert sum(a != b for a, b in zip(tokens[True], tokens[False], strict=True)) <= 1, tokens


@pytest.mark.parametrize("arch", ["qwen3", "glm"])
def test_models_it_cannot_run_exactly_keep_the_modules(tiny_models, arch):
    """q / k norms (Qwen3) and interleaved RoPE (GLM) are not what the fused step computes: no fused step,
    and decoding goes on layer by layer."""
    engine = _engine(tiny_models[arch][0])
    quantize_all(engine)
    assert int8_decode._why_not(engine.runner.model, engine.runner.caches) is not None
    out = engine.generate(_prompts(2), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in out)
    assert engine.runner._fused is not None and engine.runner._fused[1] is None


def test_a_float_or_partly_float_model_keeps_the_modules(tiny_models):
    engine = _engine(tiny_models["llama"][0])
    runner = engine.runner
    assert "int8_dynamic" in (int8_decode._why_not(runner.model, runner.caches) or "")
    quantize_all(engine, keep=("layers.1.mlp.down",))
    assert "int8_dynamic" in (int8_decode._why_not(runner.model, runner.caches) or "")
    assert Int8Decode.build(runner.model, runner.caches) is None


def test_a_step_it_does_not_serve_is_refused(tiny_models):
    engine = _engine(tiny_models["llama"][0])
    quantize_all(engine)
    runner = engine.runner
    fused = Int8Decode.build(runner.model, runner.caches)
    assert fused is not None
    from flashx_batch.models import cpu_decode

    rows = int8_decode.MAX_ROWS + 1
    tokens, positions = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
    extents = Reads.extents(cpu_decode.row_extents(positions, positions + 1))
    with pytest.raises(ValueError, match="serves"):
        fused.hidden(tokens, positions, positions, extents)
    slots = runner.caches[0][0].shape[0]
    far = Reads.extents(cpu_decode.row_extents(torch.tensor([slots]), torch.tensor([1])))
    with pytest.raises(ValueError, match="outside the cache"):
        fused.hidden(tokens[:1], positions[:1], positions[:1], far)
    near = Reads.extents(cpu_decode.row_extents(torch.tensor([0]), torch.tensor([1])))
    with pytest.raises(ValueError, match="outside the cache"):  # the new token's slot past the cache
        fused.hidden(tokens[:1], positions[:1], torch.tensor([slots]), near)
    with pytest.raises(ValueError, match="RoPE"):
        fused.hidden(tokens[:1], torch.tensor([runner.model.rotary.max_positions]), positions[:1], near)
    with pytest.raises(ValueError, match="before the cache"):
        Reads.paged(torch.tensor([[0, -1]]), torch.tensor([1]))


def test_the_fused_kernels_load_from_the_disk_cache_in_a_second_process():
    """As the other compiled kernels (tests/unit/test_cpu_decode.py): a Ray actor must not compile them again."""
    probe = ("from flashx_batch.quant import int8_decode; "
             "print(min(sum(k.stats.cache_hits.values()) for k in int8_decode._kernels().values()))")
    for _ in range(2):  # the first may compile and write the cache; the second must read it
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 1, "a fused kernel was compiled again instead of loaded from the cache"
