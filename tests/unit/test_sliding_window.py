"""Sliding-window attention (Mistral; Qwen2 with use_sliding_window, per-layer `layer_types`): windows
shorter than the prompts give `transformers`' greedy tokens and prefill logits, in every batch layout;
combinations that would merge positions are refused with the reason."""

import pytest
import torch
from model_factory import build
from parity_support import assert_batch_and_position_independent, cpu_engine, hf_greedy, prompts

from flashx_batch import SamplingParams
from flashx_batch.errors import ConfigError
from flashx_batch.models.config import ModelConfig

WINDOW = 16
NEW_TOKENS = 32
WINDOWED = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, 1 sliding
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    return {arch: (root / arch, build(arch, root / arch, **overrides)) for arch, overrides in WINDOWED.items()}


_prompts, _engine, _hf_greedy = prompts, cpu_engine, hf_greedy


def test_config_reads_which_layers_slide(windowed):
    mistral, qwen2 = (ModelConfig.from_dir(windowed[a][0]) for a in ("mistral", "qwen2"))
    assert mistral.sliding_window == WINDOW and mistral.window_layers == (True, True)
    assert qwen2.sliding_window == WINDOW and qwen2.window_layers == (False, True)


@pytest.mark.parametrize("arch", list(WINDOWED))
@pytest.mark.parametrize("layout", [{}, {"kv_layout": "stripes"}, {"refill": False}, {"sort_by_length": False},
                                    {"prefix_cache_tokens": 256}])
def test_windows_shorter_than_the_prompt_give_transformers_tokens(arch, layout, windowed):
    model_dir, hf = windowed[arch]
    engine = _engine(model_dir, **layout)
    prompts = _prompts(1, (5, 40, 17, 60, 23))  # 5 rows of mixed lengths, most past the window
    if "prefix_cache_tokens" in layout:  # rows sharing a 32-token prefix: paged batches read it from the cache
        prompts = [prompts[3][:32] + p for p in _prompts(2, (3, 20, 9, 28, 14))]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, NEW_TOKENS)
    assert engine.scheduler.allocator.refcount.count(0) >= engine.geometry.striped_segments  # rows gave theirs back


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_prefill_logits_and_last_token_prefills_match(arch, windowed):
    model_dir, hf = windowed[arch]
    engine = _engine(model_dir)
    prompts = _prompts(3, (9, 40, 64))
    packed = engine.runner.passes.prefill_packed(prompts)  # last-token-only final layer, packed rows
    for i, (prompt, logits) in enumerate(zip(prompts, engine.score(prompts))):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (logits - ref).abs().max().item() <= 1e-4
        assert (packed[i] - ref[-1]).abs().max().item() <= 1e-4
        alone, _ = engine.runner.passes.extend(prompt, 0, 0, 0)
        assert (alone[0] - ref[-1]).abs().max().item() <= 1e-4


def test_a_row_is_independent_of_its_batch_and_position(windowed):
    model_dir, _ = windowed["mistral"]
    engine = _engine(model_dir, sort_by_length=False)
    assert_batch_and_position_independent(engine, _prompts(7, (37,))[0], _prompts(8, (3, 25, 60, 8, 19)))


@pytest.mark.parametrize("knobs", [{"cache_policy": "segment_sparse"}, {"long_input": "rolling_merge"},
                                   {"backend": "onnx"}, {"cuda_graphs": "on"}])
def test_what_would_merge_positions_is_refused_with_the_reason(knobs, windowed):
    from flashx_batch.backends import get_backend
    from flashx_batch.models.config import ModelConfig as Config
    from flashx_batch.runtime.inputs import check_options
    from flashx_batch.runtime.options import EngineOptions

    cfg = Config.from_dir(windowed["mistral"][0])
    options = EngineOptions(**{"backend": "cpu", "max_input_len": 64, "max_output_len": 48, **knobs})
    with pytest.raises(ConfigError, match="sliding window of 16 tokens"):
        check_options(options, cfg, None if knobs.get("backend") == "onnx" else get_backend("cpu"))


def test_a_window_no_row_can_outgrow_is_full_attention(windowed):
    """Rows of at most 16 tokens under a 16-token window: nothing is ever masked, so the engine runs the
    model as full attention and allows what a window refuses (segment-sparse here)."""
    model_dir, hf = windowed["mistral"]
    engine = _engine(model_dir, max_input_len=8, max_output_len=8, cache_policy="segment_sparse")
    assert engine.config.sliding_window is None and engine.runner.passes.window is None
    prompt = _prompts(9, (8,))[0]
    got = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(hf, prompt, 8)  # what the windowed model computes: 16 tokens fit its window
