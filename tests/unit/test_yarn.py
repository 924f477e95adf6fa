"""YaRN rotary scaling (DeepSeek-V3 and Qwen long-context checkpoints): greedy tokens and prefill logits
equal `transformers`' — frequencies blended over the rotary channels, cos / sin scaled by the attention
factor (Qwen3 here: 0.1 ln 4 + 1), and latent attention's softmax scale sharpened by mscale_all_dim
(DeepSeek-V3)."""

import pytest
import torch
from model_factory import build
from parity_support import cpu_engine, hf_greedy, prompts

from flashx_batch import SamplingParams

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
DEEPSEEK_YARN = {**YARN, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("arch, rope", [("qwen3", YARN), ("deepseek_v3", DEEPSEEK_YARN)])
def test_yarn_matches_transformers(arch, rope, tmp_path):
    hf = build(arch, tmp_path, rope_parameters=rope)
    engine = cpu_engine(tmp_path)
    rows = prompts(1, (5, 30, 61))  # within and well past the 32-token pretrained context
    outs = engine.generate(rows, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for prompt, out in zip(rows, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 32)
    for prompt, logits in zip(rows, engine.score(rows)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (logits - ref).abs().max().item() <= 1e-4
    rope_cfg = engine.config.rope
    assert rope_cfg.rope_type == "yarn" and rope_cfg.factor == 4.0
    if arch == "qwen3":
        assert rope_cfg.attention_factor == pytest.approx(0.1 * 1.3862944 + 1)
    else:
        assert engine.config.mla.scale == pytest.approx(32**-0.5 * (0.1 * 1.3862944 + 1) ** 2)
