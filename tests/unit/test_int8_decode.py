"""The fused int8 decode step (`quant.int8_decode`) against the layer-by-layer modules it replaces: the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.backends import cpu_decode
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.quant import formats, int8_decode, int8_kernels, linear
from flashx_batch.quant.int8_decode import Int8Decode, Reads
from flashx_batch.runtime.forward_passes import ForwardPasses

pytestmark = pytest.mark.skipif(int8_kernels.compiled_kernels() is None,
                                reason="the fused kernels cannot serve this machine")


def _prompts(rows: int) -> list[list[int]]:
    return [[5 + (i * 7 + j * 3) % 200 for j in range(9 + 11 * i)] for i in range(rows)]


def _engine(path, **options) -> Engine:
    engine = Engine.from_pretrained(path, backend="cpu", dtype="float32", max_batch_size=4, max_input_len=96,
                                    max_output_len=16, **options)
    quantize_all(engine)
    return engine


def _prepacked(monkeypatch) -> None:
    """Every call through oneDNN's prepacked int8 linear, as a model whose weights are too large for `_int_mm`."""
    if not formats.onednn_int8_available():
        pytest.skip("this torch build has no oneDNN int8 linear")
    monkeypatch.setattr(linear, "INT_MM_MAX_ROWS", 0)
    monkeypatch.setattr(int8_decode, "INT_MM_MAX_ROWS", 0)


def _written(passes: ForwardPasses, slots: torch.Tensor) -> list[torch.Tensor]:
    return [part[slots].clone() for layer in passes.caches for part in layer]


@pytest.mark.parametrize("kernel", ["int_mm", "prepacked"])
def test_each_fused_step_gives_the_modules_hidden_states_and_cache_bit_for_bit(tiny_models, monkeypatch, kernel):
    """Every decode step (rows in extents of different lengths) runs both ways on the same cache: the fused
    step's hidden states and the keys and values it wrote are the modules' exactly."""
    if kernel == "prepacked":
        _prepacked(monkeypatch)
    elif formats.onednn_int8_available() and not formats.int_mm_matches_packed():
        pytest.skip("`_int_mm` and the prepacked kernel differ in the last bits on this CPU: layers keep one kernel")
    engine = _engine(tiny_models["llama"][0])
    runner, steps = engine.runner, []
    step_hidden = ForwardPasses.step_hidden

    def both(self, tokens, positions, write_flat, mask, runs, extents=None, adapters=None):
        assert extents is not None, "the engine's CPU decode steps read rows in extents"
        self.fuse_int8_decode = True
        fused = step_hidden(self, tokens, positions, write_flat, mask, runs, extents, adapters)
        written = _written(self, write_flat)
        self.fuse_int8_decode = False
        plain = step_hidden(self, tokens, positions, write_flat, mask, runs, extents, adapters)
        assert torch.equal(fused, plain), (fused - plain).abs().max()
        assert all(torch.equal(a, b) for a, b in zip(written, _written(self, write_flat), strict=True))
        steps.append(len(tokens))
        return plain

    monkeypatch.setattr(ForwardPasses, "step_hidden", both)
    out = engine.generate(_prompts(4), SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in out) and len(steps) >= 11
    gemms = [g for b in runner.passes._fused[1]._steps.values() for g in (b.qkv, b.o, b.gate_up, b.down)]
    assert gemms and all(g.int_mm == (kernel == "int_mm") for g in gemms)


def test_each_fused_paged_step_gives_the_modules_logits_bit_for_bit(tiny_models, monkeypatch):
    """The same for a paged batch (rows reading shared prefix segments through slot tables)."""
    engine = _engine(tiny_models["llama"][0], segment_size=8, prefix_cache_tokens=32)
    paged_decode, steps = ForwardPasses.paged_decode, []

    def both(self, tokens, positions, table, kv_len, adapters=None):
        writes = table.gather(1, positions)[:, 0]
        self.fuse_int8_decode = True
        fused = paged_decode(self, tokens, positions, table, kv_len, adapters)
        written = _written(self, writes)
        self.fuse_int8_decode = False
        plain = paged_decode(self, tokens, positions, table, kv_len, adapters)
        assert torch.equal(fused, plain), (fused - plain).abs().max()
        assert all(torch.equal(a, b) for a, b in zip(written, _written(self, writes), strict=True))
        steps.append(len(positions))
        return plain

    monkeypatch.setattr(ForwardPasses, "paged_decode", both)
    prompts = _prompts(3)
    prompts += [prompts[2][:18] + [7, 9, 11], prompts[2][:18] + [13]]  # share whole segments with a batch-mate
    engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert steps, "no paged decode step ran"
    assert engine.runner.passes._fused[1] is not None


@pytest.mark.parametrize("options", [{}, dict(segment_size=8, prefix_cache_tokens=32)])
def test_fused_and_layer_by_layer_decoding_give_the_same_tokens(tiny_models, options):
    """Greedy tokens end to end, each path on an engine of its own (a cold prefix cache each): identical."""
    prompts = _prompts(5)
    prompts += [prompts[2][:18] + [7, 9, 11], prompts[2][:18] + [13]]
    tokens = {}
    for fused in (True, False):
        engine = _engine(tiny_models["llama"][0], fused_int8_decode=fused, **options)
        tokens[fused] = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=16,
                                                                                      ignore_eos=True))]
        assert (engine.runner.passes._fused is not None and engine.runner.passes._fused[1] is not None) == fused
    assert tokens[True] == tokens[False]


def test_the_norm_sums_as_torch_does():
    """The lane count found for this machine reproduces torch's mean of squares on rows it was not probed with."""
    kernels = int8_kernels.compiled_kernels()
    from flashx_batch.models.layers import RMSNorm

    rng = np.random.default_rng(7)
    for width in (32, 96, 384, 1000, 3072, 8192, 20000):
        x = (rng.standard_normal((5, width)) * rng.uniform(0.05, 50)).astype(np.float32)
        norm = RMSNorm(width, 1e-5, torch.float32, torch.device("cpu"))
        norm.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, width).astype(np.float32)))
        codes, peak = np.empty(x.shape, np.uint8), np.empty((5, 1), np.float32)
        scratch, rotated = np.empty((1, width), np.float32), np.empty((1, 0), np.float32)
        kernels.norm_round(x, norm.weight.numpy(), np.float32(1e-5), kernels.lanes, np.zeros((0, 0), np.float32),
                           127.0, 0, scratch, rotated, codes, peak)
        ref_codes, ref_peak = formats.quantize_rows(norm.forward(torch.from_numpy(x)))
        assert np.array_equal(ref_codes.view(torch.uint8).numpy(), codes) and np.array_equal(ref_peak.numpy(), peak)


@pytest.mark.parametrize("arch", ["qwen3", "glm"])
def test_models_it_cannot_run_exactly_keep_the_modules(tiny_models, arch):
    """q / k norms (Qwen3) and interleaved RoPE (GLM) are not what the fused step computes: no fused step,
    and decoding goes on layer by layer."""
    engine = _engine(tiny_models[arch][0])
    reason = int8_decode._why_not(engine.runner.model, engine.runner.passes.caches)
    assert reason is not None
    # a config's reason (GLM's interleaved RoPE) is the capabilities record's: no step is even tried
    row = engine.capabilities.fused_int8_decode
    assert row.ok == (arch == "qwen3") and (row.ok or row.why == reason == "interleaved RoPE")
    out = engine.generate(_prompts(2), SamplingParams(max_new_tokens=4, ignore_eos=True))
    plain = _engine(tiny_models[arch][0], fused_int8_decode=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain.generate(
        _prompts(2), SamplingParams(max_new_tokens=4, ignore_eos=True))]  # the modules' tokens, layer by layer
    fused = engine.runner.passes._fused
    assert (fused is not None and fused[1] is None) if row.ok else fused is None


def test_a_float_or_partly_float_model_keeps_the_modules(tiny_models):
    engine = Engine.from_pretrained(tiny_models["llama"][0], backend="cpu", dtype="float32", max_batch_size=4,
                                    max_input_len=96, max_output_len=16)
    runner = engine.runner
    assert "int8_dynamic" in (int8_decode._why_not(runner.model, runner.passes.caches) or "")
    quantize_all(engine, keep=("layers.1.mlp.down",))
    assert "int8_dynamic" in (int8_decode._why_not(runner.model, runner.passes.caches) or "")
    assert Int8Decode.build(runner.model, runner.passes.caches) is None


def test_turning_it_off_survives_a_reset(tiny_models):
    """`fused_int8_decode=False` is a setting: a runner reset (after a failed step) keeps it."""
    engine = _engine(tiny_models["llama"][0], fused_int8_decode=False)
    engine.runner.reset()
    assert engine.runner.passes.fuse_int8_decode is False and engine.runner.passes.int8_decode() is None


def test_a_step_it_does_not_serve_is_refused(tiny_models):
    engine = _engine(tiny_models["llama"][0])
    runner = engine.runner
    fused = Int8Decode.build(runner.model, runner.passes.caches)
    assert fused is not None
    rows = int8_decode.MAX_ROWS + 1
    tokens, positions = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
    extents = Reads.extents(cpu_decode.row_extents(positions, positions + 1))
    with pytest.raises(ValueError, match="serves"):
        fused.hidden(tokens, positions, positions, extents)
    slots = runner.passes.caches[0][0].shape[0]
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
